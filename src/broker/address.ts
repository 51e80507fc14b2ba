/**
 * IP literals and address classes for the broker. Plain functions, no dependencies: the guest
 * can never name an address, so every spelling a resolver or URL parser might accept as an IP
 * literal is recognised here, and every resolved address is classified before it is dialled.
 */

export type IpAddress =
  | { readonly family: 4; readonly bytes: ReadonlyArray<number> }
  | { readonly family: 6; readonly bytes: ReadonlyArray<number> }

const V4_PART = /^(?:0x[0-9a-f]*|0[0-7]*|[1-9][0-9]*)$/i

/**
 * inet_aton / WHATWG-URL IPv4 parsing: 1 to 4 parts, each decimal, octal (leading 0) or hex
 * (0x); the last part fills the remaining bytes (`127.1`, `2130706433`, `0x7f.1`, `0177.0.0.1`).
 */
export const parseIpv4 = (text: string): IpAddress | undefined => {
  const parts = text.split(".")
  if (parts.length < 1 || parts.length > 4) return undefined
  const values: Array<number> = []
  for (const part of parts) {
    if (!V4_PART.test(part)) return undefined
    const value = /^0x/i.test(part)
      ? part.length === 2
        ? 0
        : parseInt(part.slice(2), 16)
      : part.length > 1 && part.startsWith("0")
        ? parseInt(part, 8)
        : parseInt(part, 10)
    if (!Number.isFinite(value)) return undefined
    values.push(value)
  }
  const last = values[values.length - 1]!
  const head = values.slice(0, -1)
  if (head.some((v) => v > 255)) return undefined
  const tailBytes = 4 - head.length
  if (last >= 2 ** (8 * tailBytes)) return undefined
  const bytes = [...head]
  for (let i = tailBytes - 1; i >= 0; i--) bytes.push(Math.floor(last / 2 ** (8 * i)) % 256)
  return { family: 4, bytes }
}

/** RFC 4291 text form, with an optional embedded dotted IPv4 tail; no brackets, no zone. */
export const parseIpv6 = (input: string): IpAddress | undefined => {
  if (!/^[0-9a-f:.]+$/i.test(input) || !input.includes(":")) return undefined
  let text = input
  const lastColon = text.lastIndexOf(":")
  const dotted = text.slice(lastColon + 1)
  if (dotted.includes(".")) {
    // an embedded dotted IPv4 tail stands for the last two groups
    if (!/^\d{1,3}(\.\d{1,3}){3}$/.test(dotted)) return undefined
    const t = dotted.split(".").map((p) => parseInt(p, 10))
    if (t.some((v) => v > 255)) return undefined
    text = `${text.slice(0, lastColon + 1)}${((t[0]! << 8) | t[1]!).toString(16)}:${((t[2]! << 8) | t[3]!).toString(16)}`
  }
  const halves = text.split("::")
  if (halves.length > 2) return undefined
  const parseGroups = (s: string): Array<number> | undefined => {
    if (s === "") return []
    const out: Array<number> = []
    for (const g of s.split(":")) {
      if (!/^[0-9a-f]{1,4}$/i.test(g)) return undefined
      out.push(parseInt(g, 16))
    }
    return out
  }
  const left = parseGroups(halves[0]!)
  const right = halves.length === 2 ? parseGroups(halves[1]!) : []
  if (left === undefined || right === undefined) return undefined
  let groups = left
  if (halves.length === 2) {
    const missing = 8 - left.length - right.length
    if (missing < 1) return undefined
    groups = [...left, ...new Array<number>(missing).fill(0), ...right]
  }
  if (groups.length !== 8) return undefined
  const bytes: Array<number> = []
  for (const g of groups) bytes.push(g >> 8, g & 0xff)
  return { family: 6, bytes }
}

const decodePercent = (text: string): string | undefined => {
  try {
    return decodeURIComponent(text)
  } catch {
    return undefined
  }
}

/**
 * The address a host string names, if it is an IP literal in any spelling: dotted or short or
 * numeric IPv4 (decimal, octal, hex, mixed), IPv6 with or without brackets, zone ids
 * (`fe80::1%eth0`, `%25`), v4-mapped forms, a trailing dot, percent-encoding.
 */
export const parseIpLiteral = (host: string): IpAddress | undefined => {
  let text = host.trim()
  if (text.includes("%")) {
    const decoded = decodePercent(text)
    if (decoded !== undefined && decoded !== text) {
      const inner = parseIpLiteral(decoded)
      if (inner !== undefined) return inner
    }
  }
  if (text.startsWith("[") && text.endsWith("]")) text = text.slice(1, -1)
  const zone = text.indexOf("%")
  if (zone >= 0 && text.includes(":")) text = text.slice(0, zone)
  if (text.endsWith(".")) text = text.slice(0, -1)
  return parseIpv4(text) ?? parseIpv6(text)
}

/**
 * True for anything that must never be treated as a name: a parseable IP literal, anything with
 * IPv6 or URL syntax (`:`, `[`, `]`, `%`, `@`, `/`, spaces), or a name whose last label is
 * numeric (no real top-level domain is, and URL parsers read such hosts as IPv4).
 */
export const looksLikeIpLiteral = (host: string): boolean => {
  if (parseIpLiteral(host) !== undefined) return true
  if (/[:[\]%@/\\\s]/.test(host)) return true
  const labels = host.replace(/\.$/, "").split(".")
  const last = labels[labels.length - 1] ?? ""
  return /^(?:0x[0-9a-f]*|[0-9]+)$/i.test(last)
}

export const formatIp = (ip: IpAddress): string => {
  if (ip.family === 4) return ip.bytes.join(".")
  const groups: Array<string> = []
  for (let i = 0; i < 16; i += 2) groups.push(((ip.bytes[i]! << 8) | ip.bytes[i + 1]!).toString(16))
  return groups.join(":")
}

interface Range {
  readonly bytes: ReadonlyArray<number>
  readonly prefix: number
  readonly label: string
}

const v4 = (dotted: string, prefix: number, label: string): Range => ({
  bytes: dotted.split(".").map((p) => parseInt(p, 10)),
  prefix,
  label
})
const v6 = (text: string, prefix: number, label: string): Range => ({
  bytes: parseIpv6(text)!.bytes,
  prefix,
  label
})

/** IPv4 ranges the broker never dials (RFC 6890 non-global, plus documentation and multicast). */
const FORBIDDEN_V4: ReadonlyArray<Range> = [
  v4("169.254.169.254", 32, "metadata"),
  v4("0.0.0.0", 8, "unspecified"),
  v4("10.0.0.0", 8, "private"),
  v4("100.64.0.0", 10, "cgnat"),
  v4("127.0.0.0", 8, "loopback"),
  v4("169.254.0.0", 16, "link-local"),
  v4("172.16.0.0", 12, "private"),
  v4("192.0.0.0", 24, "reserved"),
  v4("192.0.2.0", 24, "documentation"),
  v4("192.88.99.0", 24, "reserved"),
  v4("192.168.0.0", 16, "private"),
  v4("198.18.0.0", 15, "benchmarking"),
  v4("198.51.100.0", 24, "documentation"),
  v4("203.0.113.0", 24, "documentation"),
  v4("224.0.0.0", 4, "multicast"),
  v4("255.255.255.255", 32, "broadcast"),
  v4("240.0.0.0", 4, "reserved")
]

const FORBIDDEN_V6: ReadonlyArray<Range> = [
  v6("fd00:ec2::254", 128, "metadata"),
  v6("::", 128, "unspecified"),
  v6("::1", 128, "loopback"),
  v6("100::", 64, "discard"),
  v6("2001:db8::", 32, "documentation"),
  v6("2001::", 23, "reserved"),
  v6("fc00::", 7, "private"),
  v6("fe80::", 10, "link-local"),
  v6("fec0::", 10, "site-local"),
  v6("ff00::", 8, "multicast")
]

const inRange = (bytes: ReadonlyArray<number>, range: Range): boolean => {
  let bits = range.prefix
  for (let i = 0; bits > 0; i++, bits -= 8) {
    const mask = bits >= 8 ? 0xff : (0xff << (8 - bits)) & 0xff
    if ((bytes[i]! & mask) !== (range.bytes[i]! & mask)) return false
  }
  return true
}

const isZero = (bytes: ReadonlyArray<number>, from: number, to: number) =>
  bytes.slice(from, to).every((b) => b === 0)

/**
 * Why the broker must not dial this address (`loopback`, `private`, `metadata`, ...), or
 * undefined for a global unicast address. IPv6 forms that embed an IPv4 address (v4-mapped,
 * v4-compatible, NAT64 64:ff9b::/96, 6to4 2002::/16) are judged by the embedded address too.
 */
export const forbiddenReason = (ip: IpAddress): string | undefined => {
  if (ip.family === 4) return FORBIDDEN_V4.find((r) => inRange(ip.bytes, r))?.label
  const b = ip.bytes
  const direct = FORBIDDEN_V6.find((r) => inRange(b, r))?.label
  if (direct !== undefined) return direct
  const embedded = (from: number): IpAddress => ({ family: 4, bytes: b.slice(from, from + 4) })
  // ::ffff:a.b.c.d (mapped) and ::a.b.c.d (deprecated compatible): never dialled as such
  if (isZero(b, 0, 10) && b[10] === 0xff && b[11] === 0xff)
    return forbiddenReason(embedded(12)) ?? "v4-mapped"
  if (isZero(b, 0, 12)) return "v4-compatible"
  // 64:ff9b::/96 NAT64 and 64:ff9b:1::/48 local-use NAT64
  if (b[0] === 0x00 && b[1] === 0x64 && b[2] === 0xff && b[3] === 0x9b)
    return forbiddenReason(embedded(12)) ?? "nat64"
  if (b[0] === 0x20 && b[1] === 0x02) return forbiddenReason(embedded(2)) ?? "6to4"
  return undefined
}

/** Classify a resolver's answer (canonical text); unparseable text is refused. */
export const forbiddenAddressReason = (address: string): string | undefined => {
  const ip = parseIpLiteral(address)
  return ip === undefined ? "unparseable-address" : forbiddenReason(ip)
}
