/**
 * Protocol v4 frames (docs/protocol.md is the authoritative text). All integers big-endian:
 *
 *   offset 0  u32  payload length n (0 ≤ n ≤ MAX_FRAME_PAYLOAD)
 *   offset 4  u32  channel id (0 = control; host-opened even ids ≥ 2; guest-opened odd ids ≥ 1)
 *   offset 8  u8   kind: 0 CONTROL (channel 0 only), 1 DATA, 2 CREDIT (u32 payload), 3 EOF (empty)
 *   offset 9  n    payload
 *
 * This file checks one frame at a time: the length bound and which kind may use channel 0. The
 * rules across frames (id parity per opener, ids only growing, open-before-use, credit and
 * windows) are the Mux's (src/protocol/Mux.ts; docs/protocol.md, "Channels" and "Flow control").
 *
 * Plain TypeScript with no Effect runtime: the guest agent imports it on its start-up path.
 */

export const FRAME_HEADER_BYTES = 9
export const MAX_FRAME_PAYLOAD = 1024 * 1024
export const CONTROL_CHANNEL = 0
export const MAX_CHANNEL_ID = 0xffffffff

export const FrameKind = { Control: 0, Data: 1, Credit: 2, Eof: 3 } as const
export type FrameKind = (typeof FrameKind)[keyof typeof FrameKind]

export interface Frame {
  readonly channel: number
  readonly kind: FrameKind
  readonly payload: Uint8Array
}

/** A malformed frame (or one we refuse to build). `reason` is short and stable enough to log. */
export class FrameError extends Error {
  readonly reason: string
  constructor(reason: string) {
    super(`protocol v4 frame error: ${reason}`)
    this.name = "FrameError"
    this.reason = reason
  }
}

const kindName = (kind: number): string =>
  kind === 0 ? "CONTROL" : kind === 1 ? "DATA" : kind === 2 ? "CREDIT" : kind === 3 ? "EOF" : `kind ${kind}`

/**
 * The header rules of one frame: returns a reason when the header is not v4, else undefined.
 * Checked before any payload is buffered, so a bad or huge frame costs no allocation.
 */
export const checkHeader = (length: number, channel: number, kind: number): string | undefined => {
  if (length > MAX_FRAME_PAYLOAD) return `frame payload of ${length} bytes exceeds ${MAX_FRAME_PAYLOAD}`
  if (kind > 3) return `unknown frame kind ${kind}`
  if (kind === FrameKind.Control) {
    if (channel !== CONTROL_CHANNEL) return `CONTROL frame on data channel ${channel}`
    return undefined
  }
  if (channel === CONTROL_CHANNEL) return `${kindName(kind)} frame on the control channel`
  if (kind === FrameKind.Credit && length !== 4)
    return `CREDIT frame with a ${length}-byte payload (must be 4)`
  if (kind === FrameKind.Eof && length !== 0) return `EOF frame with a ${length}-byte payload (must be empty)`
  return undefined
}

const writeHeader = (target: Uint8Array, length: number, channel: number, kind: number): void => {
  target[0] = length >>> 24
  target[1] = (length >>> 16) & 0xff
  target[2] = (length >>> 8) & 0xff
  target[3] = length & 0xff
  target[4] = channel >>> 24
  target[5] = (channel >>> 16) & 0xff
  target[6] = (channel >>> 8) & 0xff
  target[7] = channel & 0xff
  target[8] = kind
}

const validateOutgoing = (channel: number, kind: FrameKind, length: number): void => {
  if (!Number.isInteger(channel) || channel < 0 || channel > MAX_CHANNEL_ID) {
    throw new FrameError(`channel id ${channel} is not a u32`)
  }
  const reason = checkHeader(length, channel, kind)
  if (reason !== undefined) throw new FrameError(reason)
}

/** One frame as bytes. Throws FrameError for a frame that v4 does not allow. */
export const encodeFrame = (frame: Frame): Uint8Array => {
  validateOutgoing(frame.channel, frame.kind, frame.payload.length)
  const bytes = new Uint8Array(FRAME_HEADER_BYTES + frame.payload.length)
  writeHeader(bytes, frame.payload.length, frame.channel, frame.kind)
  bytes.set(frame.payload, FRAME_HEADER_BYTES)
  return bytes
}

/**
 * The header alone of a frame whose `length`-byte payload is written right after it (as a
 * second buffer of one writev, so a big payload is never copied). The same rules as
 * `encodeFrame`: throws FrameError for a frame that v4 does not allow.
 */
export const encodeFrameHeader = (channel: number, kind: FrameKind, length: number): Uint8Array => {
  validateOutgoing(channel, kind, length)
  const bytes = new Uint8Array(FRAME_HEADER_BYTES)
  writeHeader(bytes, length, channel, kind)
  return bytes
}

/** The u32 payload of a CREDIT frame. */
export const encodeCredit = (bytes: number): Uint8Array => {
  if (!Number.isInteger(bytes) || bytes < 0 || bytes > 0xffffffff)
    throw new FrameError(`credit ${bytes} is not a u32`)
  const payload = new Uint8Array(4)
  new DataView(payload.buffer).setUint32(0, bytes)
  return payload
}

/** A whole CREDIT frame granting `bytes` on `channel` (throws FrameError unless both are valid). */
export const encodeCreditFrame = (channel: number, bytes: number): Uint8Array =>
  encodeFrame({ channel, kind: FrameKind.Credit, payload: encodeCredit(bytes) })

/** the big-endian u32 at `offset` */
const readU32 = (bytes: Uint8Array, offset: number): number =>
  ((bytes[offset]! << 24) | (bytes[offset + 1]! << 16) | (bytes[offset + 2]! << 8) | bytes[offset + 3]!) >>> 0

/** Reads a CREDIT frame's grant (the decoder has already checked the length). */
export const decodeCredit = (payload: Uint8Array): number => readU32(payload, 0)

export interface FrameDecoderOptions {
  /**
   * Return a DATA frame's payload in pieces as its bytes arrive (views of the pushed chunks, no
   * copy) instead of whole: DATA is a byte stream, so a receiver that only appends (the Mux)
   * loses nothing and saves a copy of every byte. CONTROL and CREDIT frames are always whole.
   */
  readonly streamData?: boolean
}

/**
 * Incremental decoder: push the stream's chunks as they come, get frames back. It holds at most
 * one partial frame (its header, then exactly its declared payload, at most MAX_FRAME_PAYLOAD
 * bytes; with `streamData`, a DATA payload is not held but handed out in pieces as it arrives).
 * A payload that arrives whole inside one chunk is returned as a view of that chunk (no copy).
 * After a FrameError every later call (push or finish) throws the same error.
 */
export class FrameDecoder {
  private readonly header = new Uint8Array(FRAME_HEADER_BYTES)
  private readonly streamData: boolean
  /** streamData: DATA bytes of the current frame still to come */
  private remaining = 0
  private headerFill = 0
  private payload: Uint8Array | undefined = undefined
  private payloadFill = 0
  private channel = 0
  private kind: FrameKind = 0
  private failed: FrameError | undefined = undefined

  constructor(options?: FrameDecoderOptions) {
    this.streamData = options?.streamData ?? false
  }

  /** bytes held for the frame in progress */
  get buffered(): number {
    return this.headerFill + this.payloadFill
  }

  push(chunk: Uint8Array): Array<Frame> {
    if (this.failed !== undefined) throw this.failed
    const frames: Array<Frame> = []
    let offset = 0
    const end = chunk.length
    while (offset < end) {
      if (this.remaining > 0) {
        const take = Math.min(this.remaining, end - offset)
        frames.push({
          channel: this.channel,
          kind: FrameKind.Data,
          payload: chunk.subarray(offset, offset + take)
        })
        this.remaining -= take
        offset += take
        continue
      }
      if (this.payload === undefined) {
        // fast path: a whole header inside this chunk with nothing pending
        if (this.headerFill === 0 && end - offset >= FRAME_HEADER_BYTES) {
          const length = readU32(chunk, offset)
          const channel = readU32(chunk, offset + 4)
          const kind = chunk[offset + 8]!
          this.check(length, channel, kind)
          offset += FRAME_HEADER_BYTES
          if (end - offset >= length) {
            frames.push({
              channel,
              kind: kind as FrameKind,
              payload: chunk.subarray(offset, offset + length)
            })
            offset += length
          } else {
            this.begin(length, channel, kind)
          }
          continue
        }
        const take = Math.min(FRAME_HEADER_BYTES - this.headerFill, end - offset)
        this.header.set(chunk.subarray(offset, offset + take), this.headerFill)
        this.headerFill += take
        offset += take
        if (this.headerFill < FRAME_HEADER_BYTES) break
        const length = readU32(this.header, 0)
        const channel = readU32(this.header, 4)
        const kind = this.header[8]!
        this.check(length, channel, kind)
        this.headerFill = 0
        if (length === 0) {
          frames.push({ channel, kind: kind as FrameKind, payload: new Uint8Array(0) })
          continue
        }
        this.begin(length, channel, kind)
        continue
      }
      const take = Math.min(this.payload.length - this.payloadFill, end - offset)
      this.payload.set(chunk.subarray(offset, offset + take), this.payloadFill)
      this.payloadFill += take
      offset += take
      if (this.payloadFill === this.payload.length) {
        frames.push({ channel: this.channel, kind: this.kind, payload: this.payload })
        this.payload = undefined
        this.payloadFill = 0
      }
    }
    return frames
  }

  /** The stream ended: throws FrameError when a frame was cut short. */
  finish(): void {
    if (this.failed !== undefined) throw this.failed
    if (this.remaining > 0)
      this.fail(`truncated frame: the stream ended ${this.remaining} bytes short of a DATA frame`)
    if (this.headerFill > 0 || this.payload !== undefined) {
      const got = this.payload === undefined ? this.headerFill : FRAME_HEADER_BYTES + this.payloadFill
      const want = this.payload === undefined ? FRAME_HEADER_BYTES : FRAME_HEADER_BYTES + this.payload.length
      this.fail(`truncated frame: the stream ended after ${got} of ${want} bytes`)
    }
  }

  private begin(length: number, channel: number, kind: number): void {
    this.channel = channel
    this.kind = kind as FrameKind
    if (this.streamData && kind === FrameKind.Data) {
      this.remaining = length
      return
    }
    this.payload = new Uint8Array(length)
    this.payloadFill = 0
  }

  private check(length: number, channel: number, kind: number): void {
    const reason = checkHeader(length, channel, kind)
    if (reason !== undefined) this.fail(reason)
  }

  private fail(reason: string): never {
    this.failed = new FrameError(reason)
    this.payload = undefined
    this.remaining = 0
    this.headerFill = 0
    this.payloadFill = 0
    throw this.failed
  }
}
