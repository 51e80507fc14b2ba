/**
 * The secrets a terminated host was sent never flow back to the guest: every occurrence in a
 * response's status line, headers and body is replaced with the placeholder. The body is
 * rewritten as it streams: after each chunk only a tail that could still begin a secret (the
 * longest suffix that is a proper prefix of one) is held back for the next, so a stream whose
 * chunks end in anything else (SSE events end in a blank line; a secret holds no newline) is
 * passed on at once.
 */
import { Transform, type TransformCallback } from "node:stream"
import { CREDENTIAL_PLACEHOLDER } from "../protocol/GuestConfig.js"

const PLACEHOLDER = Buffer.from(CREDENTIAL_PLACEHOLDER, "latin1")

/** one secret as bytes, with its KMP failure table (for the held-back tail) */
interface Needle {
  readonly bytes: Buffer
  readonly fail: Int32Array
}

const needle = (bytes: Buffer): Needle => {
  const fail = new Int32Array(bytes.length)
  for (let i = 1, k = 0; i < bytes.length; i++) {
    while (k > 0 && bytes[i] !== bytes[k]) k = fail[k - 1]!
    if (bytes[i] === bytes[k]) k++
    fail[i] = k
  }
  return { bytes, fail }
}

/** the length of the longest suffix of `data` that is a proper prefix of `n` */
const heldFor = (data: Buffer, n: Needle): number => {
  const from = Math.max(0, data.length - (n.bytes.length - 1))
  let k = 0
  for (let i = from; i < data.length; i++) {
    while (k > 0 && data[i] !== n.bytes[k]) k = n.fail[k - 1]!
    if (data[i] === n.bytes[k]) k++
    // a whole occurrence (there is none: they were replaced) would fall back like KMP does
    if (k === n.bytes.length) k = n.fail[k - 1]!
  }
  return k
}

/**
 * The values to replace, as the bytes they are on the wire: UTF-8 secrets, distinct, longest
 * first (a secret inside another is replaced as part of the longer one), never the placeholder.
 */
export const secretNeedles = (secrets: Iterable<string>): ReadonlyArray<Buffer> =>
  [...new Set([...secrets].filter((s) => s.length > 0 && s !== CREDENTIAL_PLACEHOLDER))]
    .map((s) => Buffer.from(s, "utf8"))
    .sort((a, b) => b.length - a.length)

/** `data` with every needle replaced, from the left; the count of replacements */
const replaceAll = (
  data: Buffer,
  needles: ReadonlyArray<Buffer>
): { readonly parts: Array<Buffer>; readonly rest: Buffer; readonly count: number } => {
  const parts: Array<Buffer> = []
  let pos = 0
  let count = 0
  for (;;) {
    let at = -1
    let len = 0
    for (const n of needles) {
      const i = data.indexOf(n, pos)
      if (i >= 0 && (at < 0 || i < at)) {
        at = i
        len = n.length
      }
    }
    if (at < 0) break
    if (at > pos) parts.push(data.subarray(pos, at))
    parts.push(PLACEHOLDER)
    count++
    pos = at + len
  }
  return { parts, rest: data.subarray(pos), count }
}

/**
 * A header value, status message or header name (node's latin1 strings: one char per byte) with
 * every secret replaced.
 */
export const redactText = (
  text: string,
  needles: ReadonlyArray<Buffer>
): { readonly text: string; readonly count: number } => {
  if (needles.length === 0) return { text, count: 0 }
  const { parts, rest, count } = replaceAll(Buffer.from(text, "latin1"), needles)
  return count === 0 ? { text, count } : { text: Buffer.concat([...parts, rest]).toString("latin1"), count }
}

/**
 * A body's bytes with every secret replaced, across chunk boundaries. `count` is the number of
 * replacements so far (final once the stream has ended).
 */
export class SecretRedactor extends Transform {
  count = 0
  private readonly needles: ReadonlyArray<Needle>
  private tail: Buffer = Buffer.alloc(0)

  constructor(needles: ReadonlyArray<Buffer>) {
    super()
    this.needles = needles.map((bytes) => needle(bytes))
  }

  override _transform(chunk: Buffer, _encoding: BufferEncoding, callback: TransformCallback): void {
    const data = this.tail.length === 0 ? chunk : Buffer.concat([this.tail, chunk])
    const { parts, rest, count } = replaceAll(
      data,
      this.needles.map((n) => n.bytes)
    )
    this.count += count
    let held = 0
    for (const n of this.needles) held = Math.max(held, heldFor(rest, n))
    // the held tail is copied: `chunk` belongs to the stream that produced it
    this.tail = Buffer.from(rest.subarray(rest.length - held))
    const out = rest.subarray(0, rest.length - held)
    if (out.length > 0) parts.push(out)
    callback(null, parts.length === 0 ? undefined : parts.length === 1 ? parts[0] : Buffer.concat(parts))
  }

  override _flush(callback: TransformCallback): void {
    const tail = this.tail
    this.tail = Buffer.alloc(0)
    callback(null, tail.length === 0 ? undefined : tail)
  }
}
