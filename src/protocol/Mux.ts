import type { Duplex } from "node:stream"
import * as Either from "effect/Either"
import * as ParseResult from "effect/ParseResult"
import * as Schema from "effect/Schema"
import {
  CONTROL_CHANNEL,
  decodeCredit,
  encodeCreditFrame,
  encodeFrame,
  encodeFrameHeader,
  FrameDecoder,
  FrameError,
  FrameKind,
  MAX_CHANNEL_ID,
  MAX_FRAME_PAYLOAD
} from "./Frame.js"
import type { Frame } from "./Frame.js"
import { ControlMessage } from "./Messages.js"

/**
 * The protocol v4 multiplexer over one byte stream (docs/protocol.md): channel 0 carries
 * Schema-validated control messages, other channels carry bytes with per-channel credit-based
 * flow control. Plain TypeScript over a Node `Duplex` (a unix socket on the host, the
 * virtio-serial port or a socket in the guest); the host wraps it in Effect in
 * src/layers/guestRpc/MuxAdapter.ts (what GuestRpcLive, in that folder, builds on).
 *
 * Memory is bounded: the decoder holds at most one frame (≤ 1 MiB), each channel buffers at most
 * its window of unread bytes (a peer that sends more is a protocol error), the control queue is
 * bounded (the socket is paused while it is full), and writers wait for credit and for the
 * stream's backpressure.
 */

/** v4's window: the unacknowledged DATA bytes a sender may have in flight per channel. */
export const INITIAL_WINDOW = 256 * 1024
/**
 * The guest's receive window (host → guest DATA), advertised in `hello.window`: a transfer keeps
 * the pipe full across scheduling delays of both ends instead of waiting for CREDIT every 256 KiB.
 */
export const GUEST_RECEIVE_WINDOW = 4 * 1024 * 1024
export const DEFAULT_MAX_CONTROL_QUEUE = 1024
/** live data channels (opened and not finished) beyond which a peer's open is a protocol error */
export const DEFAULT_MAX_CHANNELS = 1024

export interface MuxOptions {
  /** both directions' window unless one is given below (tests use smaller windows) */
  readonly initialWindow?: number
  /** the unread bytes this end accepts per channel (what it advertises; default initialWindow) */
  readonly receiveWindow?: number
  /** the peer's receive window: our initial credit per channel (default initialWindow) */
  readonly sendWindow?: number
  /** control messages held (undelivered or being handled) before the stream is paused */
  readonly maxControlQueue?: number
  /** live data channels this end holds at most; a peer opening one more is a protocol error */
  readonly maxChannels?: number
}

/** A protocol violation by the peer, or a use of a closed mux/channel. */
export class MuxError extends Error {
  readonly reason: string
  constructor(reason: string, options?: { readonly cause?: unknown }) {
    super(`protocol v4 error: ${reason}`, options?.cause === undefined ? undefined : { cause: options.cause })
    this.name = "MuxError"
    this.reason = reason
  }
}

export interface MuxChannel {
  readonly id: number
  /** waits for credit and the stream's backpressure; splits into frames ≤ MAX_FRAME_PAYLOAD */
  write(chunk: Uint8Array): Promise<void>
  /**
   * Writes at once when nothing is queued on this channel, the credit covers the chunk (≤ one
   * frame) and the stream is not backed up; returns false (and writes nothing) otherwise, in
   * which case use `write`. Saves a promise per chunk on the bulk path.
   */
  tryWrite(chunk: Uint8Array): boolean
  /** sends EOF: no more DATA from this side */
  end(): Promise<void>
  /** the peer's bytes; consuming grants credit back; ends after the peer's EOF, rejects on a failure */
  readonly readable: AsyncIterable<Uint8Array>
  /** local close: pending reads and writes fail, later DATA for it is dropped */
  destroy(reason?: string): void
}

const decodeControl = Schema.decodeUnknownEither(Schema.parseJson(ControlMessage))
const encodeControl = Schema.encodeSync(Schema.parseJson(ControlMessage))
const utf8 = new TextDecoder("utf-8", { fatal: true })
const utf8Encoder = new TextEncoder()

/**
 * Each member of ControlMessage by its `type` literal: the union would pick the same member by
 * that literal, so decoding or encoding with the member alone checks exactly as much, without
 * the union's search. Anything else (no such type, a failure) goes through the whole union, so
 * that results and error messages are the union's.
 */
interface MemberCodec {
  readonly decode: (input: unknown) => Either.Either<ControlMessage, ParseResult.ParseError>
  readonly encode: (message: ControlMessage) => Either.Either<unknown, ParseResult.ParseError>
}
const memberCodecs = new Map<string, MemberCodec>()
for (const member of ControlMessage.members) {
  const literals: ReadonlyArray<unknown> = member.fields.type.literals
  const type = literals[0]
  if (literals.length !== 1 || typeof type !== "string") continue
  if (memberCodecs.has(type)) throw new Error(`two control messages of type ${type}`)
  const schema = member as unknown as Schema.Schema<ControlMessage, unknown>
  memberCodecs.set(type, {
    decode: Schema.decodeUnknownEither(schema),
    encode: Schema.encodeEither(schema)
  })
}

/** the payload of a CONTROL frame: UTF-8 JSON of the Schema-encoded message (throws on an invalid one) */
export const encodeControlPayload = (message: ControlMessage): Uint8Array => {
  const encoded = memberCodecs.get(message.type)?.encode(message)
  return utf8Encoder.encode(
    encoded !== undefined && Either.isRight(encoded) ? JSON.stringify(encoded.right) : encodeControl(message)
  )
}

/** a CONTROL frame's payload as a message, or the reason it is not one */
export const decodeControlPayload = (payload: Uint8Array): Either.Either<ControlMessage, MuxError> => {
  let text: string
  try {
    text = utf8.decode(payload)
  } catch (cause) {
    return Either.left(new MuxError("control frame is not UTF-8", { cause }))
  }
  let json: unknown = undefined
  try {
    json = JSON.parse(text)
  } catch {
    // the union's decoder reports it
  }
  const type =
    typeof json === "object" && json !== null ? (json as { readonly type?: unknown }).type : undefined
  const member = typeof type === "string" ? memberCodecs.get(type) : undefined
  if (member !== undefined) {
    const decoded = member.decode(json)
    if (Either.isRight(decoded)) return Either.right(decoded.right)
  }
  const decoded = decodeControl(text)
  if (Either.isLeft(decoded)) {
    return Either.left(
      new MuxError(`invalid control message: ${ParseResult.TreeFormatter.formatErrorSync(decoded.left)}`, {
        cause: decoded.left
      })
    )
  }
  return Either.right(decoded.right)
}

/** small frames are written as one buffer; bigger ones as header + payload (corked: one writev) */
const CONCAT_BELOW = 16 * 1024
/**
 * Bytes the stream may hold unsent (its `writableLength`) before writers wait for 'drain'. Node's
 * own mark (16 KiB) would make every DATA frame above it wait a tick for 'drain' even when the
 * kernel took it whole; what the stream holds is bounded anyway by the channels' credit (DATA)
 * and this mark (control), so the Mux waits only when the peer really stops reading.
 */
const WRITE_HIGH_WATER = MAX_FRAME_PAYLOAD
const resolved: Promise<void> = Promise.resolve()

type ControlHandler = (message: ControlMessage) => void | Promise<unknown>

interface Deferred {
  readonly promise: Promise<void>
  readonly resolve: () => void
  readonly reject: (error: MuxError) => void
}

const deferred = (): Deferred => {
  let resolve!: () => void
  let reject!: (error: MuxError) => void
  const promise = new Promise<void>((res, rej) => {
    resolve = res
    reject = rej
  })
  // a waiter that nobody awaits any more must not become an unhandled rejection
  promise.catch(() => undefined)
  return { promise, resolve, reject }
}

class Channel implements MuxChannel {
  /** bytes we may still send (the peer's grant) */
  sendCredit: number
  /** bytes received and not yet granted back */
  private unacked = 0
  /** bytes consumed by our reader and not yet granted back */
  private consumed = 0
  private readonly chunks: Array<Uint8Array> = []
  private bufferedBytes = 0
  private readWaiter: Deferred | undefined = undefined
  private creditWaiter: Deferred | undefined = undefined
  private writeChain: Promise<void> = Promise.resolve()
  peerEof = false
  localEof = false
  failure: MuxError | undefined = undefined
  private dropped = false
  private iterating = false
  readonly readable: AsyncIterable<Uint8Array>

  constructor(
    readonly id: number,
    private readonly mux: Mux,
    /** our receive window */
    private readonly window: number,
    /** the peer's receive window */
    private readonly sendWindow: number
  ) {
    this.sendCredit = sendWindow
    this.readable = { [Symbol.asyncIterator]: () => this.iterator() }
  }

  /** unread bytes held for the reader (≤ window) */
  get buffered(): number {
    return this.bufferedBytes
  }

  // ---- receive side (called by the mux) ----

  onData(payload: Uint8Array): MuxError | undefined {
    if (this.peerEof) return new MuxError(`DATA on channel ${this.id} after its EOF`)
    this.unacked += payload.length
    if (this.unacked > this.window) {
      return new MuxError(
        `peer exceeded its credit on channel ${this.id} (${this.unacked} unacknowledged bytes, window ${this.window})`
      )
    }
    if (this.failure !== undefined) return undefined // destroyed locally: dropped
    if (payload.length === 0) return undefined
    this.chunks.push(payload)
    this.bufferedBytes += payload.length
    this.wakeReader()
    return undefined
  }

  onCredit(grant: number): MuxError | undefined {
    if (this.sendCredit + grant > this.sendWindow) {
      return new MuxError(`peer granted more credit than was sent on channel ${this.id}`)
    }
    this.sendCredit += grant
    const waiter = this.creditWaiter
    this.creditWaiter = undefined
    waiter?.resolve()
    return undefined
  }

  onEof(): MuxError | undefined {
    if (this.peerEof) return new MuxError(`second EOF on channel ${this.id}`)
    this.peerEof = true
    this.wakeReader()
    this.mux.maybeRetire(this)
    return undefined
  }

  /** `drop`: a local destroy discards unread bytes; a closing mux keeps what a finished peer sent */
  fail(error: MuxError, drop = false): void {
    if (this.failure !== undefined) return
    this.failure = error
    if (drop || !this.peerEof) {
      this.dropped = true
      this.chunks.length = 0
      this.bufferedBytes = 0
    }
    const reader = this.readWaiter
    this.readWaiter = undefined
    reader?.resolve()
    const writer = this.creditWaiter
    this.creditWaiter = undefined
    writer?.reject(error)
  }

  private wakeReader(): void {
    const waiter = this.readWaiter
    this.readWaiter = undefined
    waiter?.resolve()
  }

  /**
   * The reader: a plain iterator rather than an async generator (no generator frame and
   * promise chain per chunk); a chunk already buffered is handed out in an already-resolved
   * promise. Concurrent `next()` calls are answered in call order.
   */
  private iterator(): AsyncIterator<Uint8Array> {
    if (this.iterating) {
      const error = new MuxError(`channel ${this.id} is already being read`)
      return {
        next: () => Promise.reject(error),
        return: () => Promise.resolve({ done: true, value: undefined })
      }
    }
    this.iterating = true
    let finished = false
    const done = (): Promise<IteratorResult<Uint8Array>> => {
      finished = true
      return Promise.resolve({ done: true, value: undefined })
    }
    const next = (): Promise<IteratorResult<Uint8Array>> => {
      if (finished) return Promise.resolve({ done: true, value: undefined })
      if (this.dropped && this.failure !== undefined) {
        finished = true
        return Promise.reject(this.failure)
      }
      const chunk = this.chunks.shift()
      if (chunk !== undefined) {
        this.bufferedBytes -= chunk.length
        this.grant(chunk.length)
        return Promise.resolve({ done: false, value: chunk })
      }
      if (this.peerEof) return done()
      if (this.readWaiter === undefined) this.readWaiter = deferred()
      return this.readWaiter.promise.then(next)
    }
    return { next, return: done }
  }

  /**
   * Credit goes back in batches of a quarter window. A sender waits only once its whole window
   * is unacknowledged, and a reader that has taken a quarter of that grants it back, so batching
   * never stalls a sender; a bulk transfer then costs one CREDIT frame per quarter window, not
   * one per read (as granting whenever the buffer ran empty did).
   */
  private grant(bytes: number): void {
    this.consumed += bytes
    if (this.peerEof || this.failure !== undefined) return
    if (this.consumed >= this.window / 4) {
      const grant = this.consumed
      this.consumed = 0
      this.unacked -= grant
      this.mux.sendCredit(this.id, grant)
    }
  }

  // ---- send side ----

  /** writes and EOF queued on this channel and not finished */
  private queued = 0

  write(chunk: Uint8Array): Promise<void> {
    this.queued++
    const run = this.writeChain.then(() => this.writeNow(chunk)).finally(() => this.queued--)
    this.writeChain = run.catch(() => undefined)
    return run
  }

  tryWrite(chunk: Uint8Array): boolean {
    if (this.queued > 0 || this.failure !== undefined || this.localEof) return false
    if (chunk.length > this.sendCredit || chunk.length > MAX_FRAME_PAYLOAD || !this.mux.writable) return false
    if (chunk.length === 0) return true
    this.sendCredit -= chunk.length
    void this.mux.writeFrame(this.id, FrameKind.Data, chunk)
    return true
  }

  private async writeNow(chunk: Uint8Array): Promise<void> {
    let offset = 0
    while (offset < chunk.length) {
      if (this.failure !== undefined) throw this.failure
      if (this.localEof) throw new MuxError(`write on channel ${this.id} after its EOF`)
      if (this.sendCredit === 0) {
        this.creditWaiter = deferred()
        await this.creditWaiter.promise
        continue
      }
      const n = Math.min(this.sendCredit, chunk.length - offset, MAX_FRAME_PAYLOAD)
      this.sendCredit -= n
      await this.mux.writeFrame(this.id, FrameKind.Data, chunk.subarray(offset, offset + n))
      offset += n
    }
    if (this.failure !== undefined) throw this.failure
  }

  end(): Promise<void> {
    this.queued++
    const run = this.writeChain
      .then(async () => {
        if (this.failure !== undefined) throw this.failure
        if (this.localEof) return
        this.localEof = true
        await this.mux.writeFrame(this.id, FrameKind.Eof, new Uint8Array(0))
        this.mux.maybeRetire(this)
      })
      .finally(() => this.queued--)
    this.writeChain = run.catch(() => undefined)
    return run
  }

  destroy(reason?: string): void {
    this.fail(new MuxError(reason ?? `channel ${this.id} destroyed`), true)
    this.mux.retire(this)
  }

  /** the peer closed the channel: what it sent before its EOF is still read, then the end */
  closedByPeer(reason: string): void {
    this.fail(new MuxError(reason), false)
    this.mux.retire(this)
  }
}

export class Mux {
  private readonly decoder = new FrameDecoder({ streamData: true })
  private readonly window: number
  private peerWindow: number
  private readonly maxControlQueue: number
  private readonly channels = new Map<number, Channel>()
  /**
   * The highest channel id opened so far, per parity (index 0: even, host-opened; 1: odd,
   * guest-opened). Ids only grow, so an id at or below it that is not live is a finished
   * channel (late frames for it are dropped): no set of finished ids to grow without bound.
   */
  private readonly highest: [number, number] = [0, -1]
  private readonly maxChannels: number
  private controlHandler: ControlHandler | undefined = undefined
  private readonly controlQueue: Array<ControlMessage> = []
  private controlInFlight = 0
  private paused = false
  private readonly errorHandlers: Array<(error: MuxError) => void> = []
  private readonly closeHandlers: Array<() => void> = []
  private error: MuxError | undefined = undefined
  private closed = false
  private ending = false
  private drainWaiter: Deferred | undefined = undefined

  constructor(
    private readonly stream: Duplex,
    options?: MuxOptions
  ) {
    const initial = options?.initialWindow ?? INITIAL_WINDOW
    this.window = options?.receiveWindow ?? initial
    this.peerWindow = options?.sendWindow ?? initial
    this.maxControlQueue = options?.maxControlQueue ?? DEFAULT_MAX_CONTROL_QUEUE
    this.maxChannels = options?.maxChannels ?? DEFAULT_MAX_CHANNELS
    for (const window of [this.window, this.peerWindow]) {
      if (!Number.isInteger(window) || window < 1 || window > 0xffffffff) {
        throw new MuxError(`window ${window} is not a positive u32`)
      }
    }
    stream.on("data", (chunk: Buffer) => this.onChunk(chunk))
    stream.on("end", () => this.onEnd())
    stream.on("drain", () => this.onDrain())
    // a stream error (ECONNRESET, EPIPE) is a disconnect, reported through onClose
    stream.on("error", () => this.destroy())
    stream.on("close", () => this.onStreamClose())
    if (stream.destroyed) queueMicrotask(() => this.onStreamClose())
  }

  /** the peer's control messages in order; messages that arrived earlier are delivered now */
  onControl(handler: (message: ControlMessage) => void | Promise<unknown>): void {
    this.controlHandler = handler
    this.deliverControl()
  }

  /** protocol violations (the mux closes after reporting) */
  onError(handler: (error: MuxError) => void): void {
    this.errorHandlers.push(handler)
    const error = this.error
    if (error !== undefined) queueMicrotask(() => handler(error))
  }

  /** the stream ended or close()/destroy() was called; once */
  onClose(handler: () => void): void {
    if (this.closed) queueMicrotask(handler)
    else this.closeHandlers.push(handler)
  }

  get isClosed(): boolean {
    return this.closed
  }

  /** the unread bytes this end accepts per channel (advertised to the peer in `hello.window`) */
  /** the highest channel id the host side opened so far (0: none) */
  get highestHostChannel(): number {
    return this.highest[0]
  }

  get receiveWindow(): number {
    return this.window
  }

  /** the protocol violation that closed the mux, if any */
  get failure(): MuxError | undefined {
    return this.error
  }

  /** resolves when handed to the stream (after its backpressure, if any) */
  sendControl(message: ControlMessage): Promise<void> {
    let payload: Uint8Array
    try {
      payload = encodeControlPayload(message)
    } catch (cause) {
      return Promise.reject(new MuxError(`invalid control message: ${String(cause)}`, { cause }))
    }
    if (payload.length > MAX_FRAME_PAYLOAD) {
      return Promise.reject(
        new MuxError(`control message of ${payload.length} bytes exceeds ${MAX_FRAME_PAYLOAD}`)
      )
    }
    this.noteOutgoing(message)
    return this.writeFrame(CONTROL_CHANNEL, FrameKind.Control, payload)
  }

  /** get-or-create the local end of a data channel */
  channel(id: number): MuxChannel {
    if (!Number.isInteger(id) || id < 1 || id > MAX_CHANNEL_ID)
      throw new MuxError(`channel id ${id} is not a data channel`)
    return this.open(id)
  }

  /** graceful: pending writes are flushed, then the stream ends and is destroyed */
  close(): void {
    if (this.closed || this.ending) return
    this.ending = true
    this.failAll(new MuxError("mux closed"))
    if (this.stream.writableFinished || !this.stream.writable) {
      this.stream.destroy()
      return
    }
    this.stream.end(() => this.stream.destroy())
  }

  /** immediate: unsent bytes are dropped */
  destroy(): void {
    if (this.closed) return
    this.failAll(new MuxError("mux closed"))
    this.stream.destroy()
  }

  // ---- internals shared with Channel ----

  /** @internal open, and the stream is not backed up (no drain pending) */
  get writable(): boolean {
    return (
      !this.closed &&
      !this.ending &&
      this.drainWaiter === undefined &&
      !this.stream.destroyed &&
      this.stream.writable
    )
  }

  /** @internal */
  writeFrame(channel: number, kind: FrameKind, payload: Uint8Array): Promise<void> {
    if (this.closed || this.ending || this.stream.destroyed || !this.stream.writable) {
      return Promise.reject(this.error ?? new MuxError("mux closed"))
    }
    let ok: boolean
    if (payload.length < CONCAT_BELOW) {
      ok = this.stream.write(encodeFrame({ channel, kind, payload }))
    } else {
      this.stream.cork()
      this.stream.write(encodeFrameHeader(channel, kind, payload.length))
      ok = this.stream.write(payload)
      this.stream.uncork()
    }
    if (ok || this.stream.writableLength < WRITE_HIGH_WATER) return resolved
    if (this.drainWaiter === undefined) this.drainWaiter = deferred()
    return this.drainWaiter.promise
  }

  /** @internal credit is never held back by backpressure: it is what unblocks the peer */
  sendCredit(channel: number, bytes: number): void {
    if (this.closed || this.ending || this.stream.destroyed || !this.stream.writable || bytes === 0) return
    this.stream.write(encodeCreditFrame(channel, bytes))
  }

  /** @internal */
  maybeRetire(channel: Channel): void {
    if (channel.peerEof && channel.localEof && channel.buffered === 0) {
      // keep the object for its reader; only forget it for lookups of late frames
      if (this.channels.get(channel.id) === channel) this.channels.delete(channel.id)
    }
  }

  /** @internal */
  retire(channel: Channel): void {
    if (this.channels.get(channel.id) === channel) this.channels.delete(channel.id)
  }

  /** live data channels (opened, not finished) */
  get liveChannels(): number {
    return this.channels.size
  }

  /** a finished channel: its id was opened before (ids only grow) and it is no longer live */
  private isRetired(id: number): boolean {
    return id <= this.highest[id & 1]! && !this.channels.has(id)
  }

  // ---- receive path ----

  private open(id: number): Channel {
    let channel = this.channels.get(id)
    if (channel === undefined) {
      channel = new Channel(id, this, this.window, this.peerWindow)
      if (this.closed || this.ending) channel.fail(this.error ?? new MuxError("mux closed"))
      else if (this.isRetired(id)) {
        // a finished channel is never opened again: its local end is closed from the start
        channel.fail(new MuxError(`channel ${id} is finished`), true)
        return channel
      }
      this.highest[id & 1] = Math.max(this.highest[id & 1]!, id)
      this.channels.set(id, channel)
    }
    return channel
  }

  /** control messages that open or close channels, in either direction */
  private noteOutgoing(message: ControlMessage): void {
    if (
      message.type === "transfer_begin" ||
      message.type === "forward_open" ||
      message.type === "export_begin"
    )
      this.open(message.channel)
    else if (message.type === "user_turn" && message.output !== undefined) this.open(message.output)
    else if (message.type === "tunnel_deny" || message.type === "tunnel_close") {
      const channel = this.channels.get(message.channel)
      if (channel !== undefined) channel.destroy(`tunnel ${message.channel} closed`)
    }
  }

  private noteIncoming(message: ControlMessage): MuxError | undefined {
    switch (message.type) {
      case "hello":
        // the guest's receive window: our credit on the channels opened from now on
        if (message.window !== undefined) this.peerWindow = message.window
        return undefined
      case "user_turn": // a turn's output channel (FEATURE_OUTPUT) is opened by the host like a transfer's
      case "transfer_begin":
      case "export_begin":
      case "tunnel_open":
      case "forward_open": {
        const id = message.type === "user_turn" ? message.output : message.channel
        if (id === undefined) return undefined
        if (!Number.isInteger(id) || id < 1 || id > MAX_CHANNEL_ID) {
          return new MuxError(`${message.type} names channel ${id}, not a data channel`)
        }
        // the host opens even ids (transfers), the guest odd ones (tunnels); each side counts up
        const parity = message.type === "tunnel_open" ? 1 : 0
        if ((id & 1) !== parity) {
          return new MuxError(
            `${message.type} names channel ${id}: ${parity === 0 ? "the host opens even ids" : "tunnels use odd ids"}`
          )
        }
        if (id <= this.highest[parity]!) {
          return new MuxError(
            `${message.type} names channel ${id}, ${this.channels.has(id) ? "a channel that is open" : "an id already used"} (ids are never reused)`
          )
        }
        if (this.channels.size >= this.maxChannels) {
          return new MuxError(`${message.type} would open more than ${this.maxChannels} channels at once`)
        }
        this.open(id)
        return undefined
      }
      case "tunnel_close": {
        const channel = this.channels.get(message.channel)
        if (channel !== undefined) channel.closedByPeer(`tunnel ${message.channel} closed by the peer`)
        return undefined
      }
      default:
        return undefined
    }
  }

  private onChunk(chunk: Buffer): void {
    if (this.closed || this.error !== undefined) return
    let frames: Array<Frame>
    try {
      frames = this.decoder.push(chunk)
    } catch (cause) {
      this.protocolError(cause instanceof FrameError ? cause.reason : String(cause), cause)
      return
    }
    this.backlog =
      this.backlogAt < this.backlog.length ? [...this.backlog.slice(this.backlogAt), ...frames] : frames
    this.backlogAt = 0
    this.processBacklog()
  }

  /**
   * Frames of the chunks read so far, handled in order until the control queue is full: one
   * chunk can hold hundreds of small frames, and the pause must take effect between frames (a
   * peer's opens would otherwise outrun the bound by a chunk's worth), not only between reads.
   */
  private backlog: Array<Frame> = []
  private backlogAt = 0
  private processing = false

  private processBacklog(): void {
    if (this.processing) return
    this.processing = true
    try {
      this.drainBacklog()
    } finally {
      this.processing = false
    }
  }

  private drainBacklog(): void {
    while (this.backlogAt < this.backlog.length && !this.paused) {
      if (this.closed || this.error !== undefined) return
      const frame = this.backlog[this.backlogAt++]!
      const problem = this.onFrame(frame)
      if (problem !== undefined) {
        this.protocolError(problem.reason, problem.cause)
        return
      }
    }
    if (this.backlogAt >= this.backlog.length) {
      this.backlog = []
      this.backlogAt = 0
    }
  }

  private onFrame(frame: Frame): MuxError | undefined {
    if (frame.kind === FrameKind.Control) {
      const decoded = decodeControlPayload(frame.payload)
      if (Either.isLeft(decoded)) return decoded.left
      const problem = this.noteIncoming(decoded.right)
      if (problem !== undefined) return problem
      this.controlQueue.push(decoded.right)
      this.deliverControl()
      return undefined
    }
    const channel = this.channels.get(frame.channel)
    if (channel === undefined) {
      if (this.isRetired(frame.channel)) return undefined // late frames of a finished channel
      return new MuxError(
        `${frame.kind === FrameKind.Data ? "DATA" : frame.kind === FrameKind.Credit ? "CREDIT" : "EOF"} on unopened channel ${frame.channel}`
      )
    }
    switch (frame.kind) {
      case FrameKind.Data:
        return channel.onData(frame.payload)
      case FrameKind.Credit:
        return channel.onCredit(decodeCredit(frame.payload))
      case FrameKind.Eof:
        return channel.onEof()
    }
  }

  private deliverControl(): void {
    while (this.controlHandler !== undefined && this.controlQueue.length > 0) {
      const message = this.controlQueue.shift()!
      let result: void | Promise<unknown>
      try {
        result = this.controlHandler(message)
      } catch {
        result = undefined // a throwing handler is the caller's bug; the mux keeps going
      }
      if (result !== undefined && typeof (result as Promise<unknown>).then === "function") {
        this.controlInFlight++
        ;(result as Promise<unknown>).then(
          () => this.controlSettled(),
          () => this.controlSettled()
        )
      }
    }
    this.updatePause()
  }

  private controlSettled(): void {
    this.controlInFlight--
    this.updatePause()
  }

  private updatePause(): void {
    const held = this.controlQueue.length + this.controlInFlight
    if (!this.paused && held >= this.maxControlQueue) {
      this.paused = true
      this.stream.pause()
    } else if (this.paused && held < this.maxControlQueue) {
      this.paused = false
      this.processBacklog()
      if (!this.paused && !this.closed) this.stream.resume()
    }
  }

  private onEnd(): void {
    try {
      this.decoder.finish()
    } catch (cause) {
      this.protocolError(cause instanceof FrameError ? cause.reason : String(cause), cause)
      return
    }
    this.destroy()
  }

  private onDrain(): void {
    const waiter = this.drainWaiter
    this.drainWaiter = undefined
    waiter?.resolve()
  }

  private protocolError(reason: string, cause?: unknown): void {
    if (this.error !== undefined || this.closed) return
    const error = new MuxError(reason, { cause })
    this.error = error
    for (const handler of this.errorHandlers) handler(error)
    this.failAll(error)
    this.stream.destroy()
  }

  private failAll(error: MuxError): void {
    for (const channel of this.channels.values()) channel.fail(error)
    const drain = this.drainWaiter
    this.drainWaiter = undefined
    drain?.reject(error)
  }

  private onStreamClose(): void {
    if (this.closed) return
    this.closed = true
    this.failAll(this.error ?? new MuxError("connection closed"))
    const handlers = this.closeHandlers.splice(0)
    for (const handler of handlers) handler()
  }
}
