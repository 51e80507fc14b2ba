/**
 * The TLS ClientHello of a pass-through tunnel, read before any byte goes upstream: its SNI must
 * name the tunnel's host, or a guest could CONNECT to an allowed host of a shared front end and
 * ask it for another tenant (domain fronting). Plain functions over bytes and node streams.
 */
import type { Duplex } from "node:stream"
import { normalizeHost } from "./host.js"

export type ClientHelloPeek =
  /** more bytes are needed */
  | { readonly status: "incomplete" }
  /** the host names of the server_name extension (empty: no SNI) */
  | { readonly status: "hello"; readonly serverNames: ReadonlyArray<string> }
  | { readonly status: "not-tls"; readonly reason: string }

/** the largest ClientHello accepted (handshake message body) */
export const MAX_CLIENT_HELLO = 64 * 1024

const HANDSHAKE = 22
const CLIENT_HELLO = 1
const EXT_SERVER_NAME = 0
const HOST_NAME = 0

const bad = (reason: string): ClientHelloPeek => ({ status: "not-tls", reason })

/**
 * The handshake bytes carried by the leading handshake records of `data`; `stopped`: a record of
 * another type follows them (early data may follow a complete ClientHello, never split one).
 */
const handshakeBytes = (data: Uint8Array): { bytes: Uint8Array; stopped: boolean; error?: string } => {
  const parts: Array<Uint8Array> = []
  let offset = 0
  let total = 0
  let stopped = false
  while (offset + 5 <= data.length) {
    if (data[offset] !== HANDSHAKE) {
      stopped = true
      break
    }
    if (data[offset + 1] !== 3)
      return { bytes: new Uint8Array(0), stopped, error: "not a TLS record version" }
    const length = (data[offset + 3]! << 8) | data[offset + 4]!
    if (length === 0 || length > 16384)
      return { bytes: new Uint8Array(0), stopped, error: "bad record length" }
    const end = Math.min(offset + 5 + length, data.length)
    parts.push(data.subarray(offset + 5, end))
    total += end - offset - 5
    if (end < offset + 5 + length) break
    offset = end
  }
  const bytes = new Uint8Array(total)
  let at = 0
  for (const part of parts) {
    bytes.set(part, at)
    at += part.length
  }
  return { bytes, stopped }
}

/** Look at the first bytes a guest sent on a pass-through tunnel. */
export const peekClientHello = (data: Uint8Array): ClientHelloPeek => {
  if (data.length === 0) return { status: "incomplete" }
  if (data[0] !== HANDSHAKE) return bad("not a TLS handshake")
  const { bytes: hs, stopped, error } = handshakeBytes(data)
  if (error !== undefined) return bad(error)
  const incomplete = stopped
    ? bad("ClientHello interrupted by another record")
    : { status: "incomplete" as const }
  if (hs.length < 4) return incomplete
  if (hs[0] !== CLIENT_HELLO) return bad("not a ClientHello")
  const length = (hs[1]! << 16) | (hs[2]! << 8) | hs[3]!
  if (length > MAX_CLIENT_HELLO) return bad("ClientHello too large")
  if (hs.length < 4 + length) return incomplete
  const body = hs.subarray(4, 4 + length)

  let p = 0
  const need = (n: number) => p + n <= body.length
  const u8 = () => body[p++]!
  const u16 = () => {
    const v = (body[p]! << 8) | body[p + 1]!
    p += 2
    return v
  }
  // legacy_version, random
  if (!need(34)) return bad("truncated ClientHello")
  p += 34
  // legacy_session_id
  if (!need(1)) return bad("truncated ClientHello")
  const sessionId = u8()
  if (!need(sessionId)) return bad("truncated ClientHello")
  p += sessionId
  // cipher_suites
  if (!need(2)) return bad("truncated ClientHello")
  const suites = u16()
  if (!need(suites)) return bad("truncated ClientHello")
  p += suites
  // legacy_compression_methods
  if (!need(1)) return bad("truncated ClientHello")
  const compression = u8()
  if (!need(compression)) return bad("truncated ClientHello")
  p += compression
  // no extensions: no SNI
  if (p === body.length) return { status: "hello", serverNames: [] }
  if (!need(2)) return bad("truncated ClientHello")
  const extensionsLength = u16()
  const extensionsEnd = p + extensionsLength
  if (extensionsEnd > body.length) return bad("truncated extensions")
  const serverNames: Array<string> = []
  while (p < extensionsEnd) {
    if (p + 4 > extensionsEnd) return bad("truncated extension")
    const type = u16()
    const extLength = u16()
    const extEnd = p + extLength
    if (extEnd > extensionsEnd) return bad("truncated extension")
    if (type === EXT_SERVER_NAME) {
      if (extLength < 2) return bad("bad server_name extension")
      const listLength = u16()
      const listEnd = p + listLength
      if (listEnd !== extEnd) return bad("bad server_name extension")
      while (p < listEnd) {
        if (p + 3 > listEnd) return bad("bad server_name extension")
        const nameType = u8()
        const nameLength = u16()
        if (p + nameLength > listEnd) return bad("bad server_name extension")
        const name = Buffer.from(body.subarray(p, p + nameLength)).toString("latin1")
        // other name types are kept as a name that matches nothing
        serverNames.push(nameType === HOST_NAME ? name : `\u0000type-${nameType}`)
        p += nameLength
      }
    }
    p = extEnd
  }
  return { status: "hello", serverNames }
}

export type ClientHelloCheck =
  | { readonly ok: true; readonly head: Buffer }
  | {
      readonly ok: false
      /** `sni-missing`, `sni-mismatch`, `not-tls`, `hello-timeout`, `closed-before-hello` */
      readonly reason: string
    }

/**
 * Read a guest's first bytes until its ClientHello is whole, and check that every name of its
 * SNI is `host` (normalised; a ClientHello without SNI is refused). On success `head` holds the
 * bytes read, to be sent upstream first; the stream is left paused with no listener of ours.
 */
export const readClientHello = (
  stream: Duplex,
  host: string,
  options: { readonly timeoutMs: number }
): Promise<ClientHelloCheck> =>
  new Promise((resolve) => {
    const chunks: Array<Buffer> = []
    let size = 0
    const finish = (result: ClientHelloCheck) => {
      clearTimeout(timer)
      stream.off("data", onData)
      stream.off("end", onEnd)
      stream.off("close", onEnd)
      stream.pause()
      resolve(result)
    }
    const onEnd = () => finish({ ok: false, reason: "closed-before-hello" })
    const onData = (chunk: Buffer) => {
      chunks.push(chunk)
      size += chunk.length
      const head = Buffer.concat(chunks, size)
      const peek = peekClientHello(head)
      if (peek.status === "incomplete") {
        if (size > MAX_CLIENT_HELLO + 1024) finish({ ok: false, reason: "not-tls" })
        return
      }
      if (peek.status === "not-tls") return finish({ ok: false, reason: "not-tls" })
      if (peek.serverNames.length === 0) return finish({ ok: false, reason: "sni-missing" })
      const matches = peek.serverNames.every((name) => {
        const checked = normalizeHost(name)
        return checked.ok && checked.host === host
      })
      finish(matches ? { ok: true, head } : { ok: false, reason: "sni-mismatch" })
    }
    const timer = setTimeout(() => finish({ ok: false, reason: "hello-timeout" }), options.timeoutMs)
    stream.on("data", onData)
    stream.once("end", onEnd)
    stream.once("close", onEnd)
  })
