import { describe, expect, it } from "@effect/vitest"
import * as fc from "fast-check"
import * as net from "node:net"
import {
  forbiddenAddressReason,
  forbiddenReason,
  formatIp,
  looksLikeIpLiteral,
  parseIpLiteral
} from "../src/broker/address.js"
import { matchesHostPattern, normalizeHost } from "../src/broker/host.js"
import { type BrokerPolicy, checkResolved, decide } from "../src/broker/policy.js"

const policy: BrokerPolicy = {
  format: 1,
  allow: [
    { host: "allowed.com", ports: [443] },
    { host: "*.github.com", ports: [443, 8443] }
  ],
  credentials: [],
  resolve: {}
}

const byte = fc.integer({ min: 0, max: 255 })
const v4Bytes = fc.tuple(byte, byte, byte, byte)

/** non-global IPv4 ranges as [first byte pattern]: generate addresses inside them */
const forbiddenV4 = fc.oneof(
  fc.tuple(fc.constant(127), byte, byte, byte),
  fc.tuple(fc.constant(10), byte, byte, byte),
  fc.tuple(fc.constant(172), fc.integer({ min: 16, max: 31 }), byte, byte),
  fc.tuple(fc.constant(192), fc.constant(168), byte, byte),
  fc.tuple(fc.constant(169), fc.constant(254), byte, byte),
  fc.tuple(fc.constant(100), fc.integer({ min: 64, max: 127 }), byte, byte),
  fc.tuple(fc.constant(0), byte, byte, byte),
  fc.tuple(fc.integer({ min: 224, max: 255 }), byte, byte, byte)
)

const num = (bytes: ReadonlyArray<number>) => bytes.reduce((acc, b) => acc * 256 + b, 0)
const hex16 = (a: number, b: number) => ((a << 8) | b).toString(16)

type Spelling = (b: readonly [number, number, number, number], pick: number) => string
const part = (value: number, pick: number) =>
  pick % 3 === 0 ? String(value) : pick % 3 === 1 ? `0${value.toString(8)}` : `0x${value.toString(16)}`
const spellings: ReadonlyArray<Spelling> = [
  (b) => b.join("."),
  (b) => String(num(b)),
  (b) => `0x${num(b).toString(16)}`,
  (b) => `0X${num(b).toString(16).toUpperCase()}`,
  (b) => `0${num(b).toString(8)}`,
  (b, pick) => b.map((v, i) => part(v, pick + i)).join("."),
  (b, pick) => `${part(b[0], pick)}.${part(b[1], pick + 1)}.${part(b[2] * 256 + b[3], pick + 2)}`,
  (b, pick) => `${part(b[0], pick)}.${part(b[1] * 65536 + b[2] * 256 + b[3], pick + 1)}`,
  (b) => `${b.join(".")}.`,
  (b) => `::ffff:${b.join(".")}`,
  (b) => `[::ffff:${b.join(".")}]`,
  (b) => `::ffff:${hex16(b[0], b[1])}:${hex16(b[2], b[3])}`,
  (b) => `[0:0:0:0:0:ffff:${b.join(".")}]`,
  (b) => `[::FFFF:${hex16(b[0], b[1]).toUpperCase()}:${hex16(b[2], b[3])}]`,
  (b) => b.join(".").replace(/^(\d)/, (d) => `%3${d}`),
  (b) => `%5B::ffff:${b.join(".")}%5D`
]
const isMapped = (i: number) => (i >= 9 && i <= 13) || i === 15

describe("IP literal parser (every spelling)", () => {
  it("table: known spellings of 127.0.0.1 and friends", () => {
    const table: ReadonlyArray<readonly [string, string]> = [
      ["127.0.0.1", "127.0.0.1"],
      ["127.1", "127.0.0.1"],
      ["127.0.1", "127.0.0.1"],
      ["2130706433", "127.0.0.1"],
      ["0x7f000001", "127.0.0.1"],
      ["0177.0.0.1", "127.0.0.1"],
      ["0x7f.1", "127.0.0.1"],
      ["0x7F.0x0.0.01", "127.0.0.1"],
      ["127.0.0.1.", "127.0.0.1"],
      ["%31%32%37.0.0.1", "127.0.0.1"],
      ["0", "0.0.0.0"],
      ["::1", "0:0:0:0:0:0:0:1"],
      ["[::1]", "0:0:0:0:0:0:0:1"],
      ["::ffff:127.0.0.1", "0:0:0:0:0:ffff:7f00:1"],
      ["[::ffff:7f00:1]", "0:0:0:0:0:ffff:7f00:1"],
      ["fe80::1%eth0", "fe80:0:0:0:0:0:0:1"],
      ["[fe80::1%25eth0]", "fe80:0:0:0:0:0:0:1"],
      ["fd00:ec2::254", "fd00:ec2:0:0:0:0:0:254"]
    ]
    for (const [input, expected] of table) {
      const ip = parseIpLiteral(input)
      expect(ip === undefined ? undefined : formatIp(ip)).toBe(expected)
      expect(looksLikeIpLiteral(input)).toBe(true)
    }
    for (const name of [
      "example.com",
      "1.2.3.4.nip.io",
      "api.github.com",
      "xn--bcher-kva.example",
      "0x.example"
    ]) {
      expect(parseIpLiteral(name)).toBeUndefined()
      expect(looksLikeIpLiteral(name)).toBe(false)
    }
    for (const odd of ["1.2.3.999", "256.1.1.1", "a.b.123", "example.0x1f", "::1::", "[::1", "a:b"]) {
      expect(looksLikeIpLiteral(odd)).toBe(true)
    }
  })

  it("property: every spelling of an IPv4 address parses to that address", () => {
    fc.assert(
      fc.property(v4Bytes, fc.nat({ max: spellings.length - 1 }), fc.nat(), (b, which, pick) => {
        const text = spellings[which]!(b, pick)
        const ip = parseIpLiteral(text)
        expect(ip, text).toBeDefined()
        const bytes = isMapped(which) ? ip!.bytes.slice(12) : ip!.bytes
        if (isMapped(which)) expect(ip!.bytes.slice(0, 12)).toEqual([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 255, 255])
        expect(bytes).toEqual(b)
        expect(looksLikeIpLiteral(text)).toBe(true)
      }),
      { numRuns: 2000 }
    )
  })

  it("property: any encoding of a private/loopback/link-local/multicast address is refused and classified", () => {
    fc.assert(
      fc.property(
        forbiddenV4,
        fc.nat({ max: spellings.length - 1 }),
        fc.nat(),
        fc.constantFrom(443, 8443),
        (b, which, pick, port) => {
          const text = spellings[which]!(b, pick)
          expect(decide(policy, text, port)).toEqual({ allow: false, reason: "ip-literal" })
          expect(forbiddenReason(parseIpLiteral(text)!)).toBeDefined()
          // as a resolver answer, too
          expect(checkResolved([b.join(".")]).ok).toBe(false)
          expect(checkResolved([`::ffff:${b.join(".")}`]).ok).toBe(false)
        }
      ),
      { numRuns: 2000 }
    )
  })

  it("property: whatever the WHATWG URL parser reads as an IPv4 host, the broker reads as an IP literal too", () => {
    const token = fc.constantFrom(
      "0",
      "1",
      "7",
      "9",
      "00",
      "08",
      "0x",
      "0X",
      "f",
      "a",
      "ff",
      "255",
      "256",
      "4294967295",
      "99999"
    )
    const host = fc
      .array(
        fc.array(token, { minLength: 1, maxLength: 3 }).map((t) => t.join("")),
        { minLength: 1, maxLength: 5 }
      )
      .map((labels) => labels.join("."))
    fc.assert(
      fc.property(host, fc.boolean(), (text, trailingDot) => {
        const candidate = trailingDot ? `${text}.` : text
        let urlHost: string | undefined
        try {
          urlHost = new URL(`https://${candidate}/`).hostname
        } catch {
          urlHost = undefined // the URL parser refuses it: a client could not send it either
        }
        if (urlHost !== undefined && net.isIPv4(urlHost)) {
          expect(looksLikeIpLiteral(candidate), candidate).toBe(true)
          expect(formatIp(parseIpLiteral(candidate)!)).toBe(urlHost)
        }
        if (urlHost !== undefined && !net.isIPv4(urlHost)) {
          // a name to the URL parser: fine for the broker either way, but never a different address
          const ip = parseIpLiteral(candidate)
          if (ip !== undefined) expect(ip.family).toBe(4)
        }
      }),
      { numRuns: 3000 }
    )
  })

  it("property: IPv6 text forms (compressed, uppercase, bracketed, zone) parse to their bytes; node agrees", () => {
    const group = fc.integer({ min: 0, max: 0xffff })
    fc.assert(
      fc.property(
        fc.array(group, { minLength: 8, maxLength: 8 }),
        fc.nat({ max: 7 }),
        fc.nat({ max: 8 }),
        fc.boolean(),
        fc.boolean(),
        (groups, start, length, upper, bracket) => {
          const text = groups.map((g) => g.toString(16)).join(":")
          const end = Math.min(8, start + length)
          const zeroed = groups.map((g, i) => (i >= start && i < end ? 0 : g))
          const compressed =
            end - start >= 1
              ? `${zeroed
                  .slice(0, start)
                  .map((g) => g.toString(16))
                  .join(":")}::${zeroed
                  .slice(end)
                  .map((g) => g.toString(16))
                  .join(":")}`
              : text
          const spelled = upper ? compressed.toUpperCase() : compressed
          expect(net.isIPv6(spelled)).toBe(true)
          const ip = parseIpLiteral(bracket ? `[${spelled}%25en0]` : spelled)
          const expectedGroups = end - start >= 1 ? zeroed : groups
          expect(ip && formatIp(ip)).toBe(expectedGroups.map((g) => g.toString(16)).join(":"))
          expect(looksLikeIpLiteral(spelled)).toBe(true)
        }
      ),
      { numRuns: 2000 }
    )
  })

  it("resolver answers: global unicast passes, every non-global class is refused", () => {
    for (const ok of ["93.184.215.14", "8.8.8.8", "2606:4700:4700::1111", "2a00:1450:4001::200e"])
      expect(forbiddenAddressReason(ok)).toBeUndefined()
    const refused: ReadonlyArray<readonly [string, string]> = [
      ["127.0.0.1", "loopback"],
      ["10.1.2.3", "private"],
      ["172.31.255.255", "private"],
      ["192.168.0.1", "private"],
      ["100.100.100.100", "cgnat"],
      ["169.254.10.10", "link-local"],
      ["169.254.169.254", "metadata"],
      ["0.0.0.0", "unspecified"],
      ["224.0.0.251", "multicast"],
      ["255.255.255.255", "broadcast"],
      ["::1", "loopback"],
      ["::", "unspecified"],
      ["fc00::1", "private"],
      ["fd00:ec2::254", "metadata"],
      ["fe80::1", "link-local"],
      ["ff02::1", "multicast"],
      ["::ffff:10.0.0.1", "private"],
      ["64:ff9b::a9fe:a9fe", "metadata"],
      ["2002:7f00:1::", "loopback"],
      ["not-an-address", "unparseable-address"]
    ]
    for (const [address, reason] of refused)
      expect([address, forbiddenAddressReason(address)]).toEqual([address, reason])
    expect(checkResolved(["8.8.8.8", "10.0.0.1"])).toEqual({ ok: false, reason: "address-private" })
    expect(checkResolved([])).toEqual({ ok: false, reason: "resolve-failed" })
    expect(checkResolved(["8.8.8.8", "1.1.1.1"])).toEqual({ ok: true, address: "8.8.8.8" })
  })
})

describe("host pattern matcher", () => {
  const label = fc.stringMatching(/^[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?$/)
  const tld = fc.stringMatching(/^[a-z]{2,6}$/)
  const name = fc
    .tuple(fc.array(label, { minLength: 1, maxLength: 4 }), tld)
    .map(([ls, t]) => [...ls, t].join("."))

  it("property: `*.suffix` matches exactly the names that end in `.suffix` on a label boundary", () => {
    fc.assert(
      fc.property(name, name, (suffix, host) => {
        const labels = host.split(".")
        const boundaryTails = labels.slice(1).map((_, i) => labels.slice(i + 1).join("."))
        expect(matchesHostPattern(`*.${suffix}`, host)).toBe(boundaryTails.includes(suffix))
        expect(matchesHostPattern(`*.${suffix}`, suffix)).toBe(false)
        expect(matchesHostPattern(`*.${suffix}`, `${label}${suffix}`)).toBe(false)
      }),
      { numRuns: 2000 }
    )
  })

  it("property: an exact pattern matches only its own name (any case, one trailing dot)", () => {
    fc.assert(
      fc.property(name, name, fc.boolean(), (pattern, host, dot) => {
        const checked = normalizeHost(dot ? `${host.toUpperCase()}.` : host)
        expect(checked.ok).toBe(true)
        if (checked.ok) expect(matchesHostPattern(pattern, checked.host)).toBe(pattern === host)
      }),
      { numRuns: 2000 }
    )
  })

  it("property: prefixing, suffixing or splicing an allowed name never gets through", () => {
    fc.assert(
      fc.property(label, name, fc.constantFrom(".", "", "-"), (extra, evil, glue) => {
        for (const host of [
          `allowed.com.${evil}`,
          `${extra}${glue === "." ? "" : glue}allowed.com`,
          `${evil}.allowed.com`,
          `allowed.com${glue}${extra}.com`
        ]) {
          const verdict = decide(policy, host, 443)
          expect(verdict.allow).toBe(false)
        }
        for (const host of [`${extra}.github.com`, `${extra}.${extra}.github.com`])
          expect(decide(policy, host, 443).allow).toBe(true)
        expect(decide(policy, `${extra}.github.com`, 444)).toEqual({
          allow: false,
          reason: "port-not-allowed"
        })
        expect(decide(policy, `github.com.${evil}`, 443).allow).toBe(false)
      }),
      { numRuns: 1000 }
    )
  })
})
