import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Runtime from "effect/Runtime"
import type * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import { Duplex } from "node:stream"
import type { GuestDisconnected } from "../services/GuestRpc.js"

/** bytes queued towards the guest before node's writes wait */
const WRITE_BUFFER = 256 * 1024
/** largest coalesced channel write */
const MAX_BATCH = 64 * 1024
/** bytes from the guest buffered before the reader waits */
const READ_BUFFER = 256 * 1024

/** The accepted side of a `TunnelRequest`: protocol channel reads, writes and close. */
export interface TunnelChannel {
  readonly read: Stream.Stream<Uint8Array, GuestDisconnected>
  readonly write: (chunk: Uint8Array) => Effect.Effect<void, GuestDisconnected>
  readonly close: Effect.Effect<void>
}

export interface ChannelDuplex {
  /** a node Duplex over the channel: node:tls, node:http and sockets plug into it */
  readonly duplex: Duplex
  /** bytes from the guest so far */
  readonly bytesUp: () => number
  /** bytes to the guest so far */
  readonly bytesDown: () => number
  /** completes when the duplex is closed (either side) */
  readonly closed: Effect.Effect<void>
}

/**
 * Bridge a tunnel channel to a node Duplex, with backpressure both ways: a reader fiber (in the
 * given scope) pushes guest bytes and waits when node's buffer is full; node's writes wait for
 * the channel's write. Node streams call back outside Effect, so the captured runtime runs the
 * channel's effects from those callbacks.
 */
export const channelDuplex = (channel: TunnelChannel): Effect.Effect<ChannelDuplex, never, Scope.Scope> =>
  Effect.gen(function* () {
    const runtime = yield* Effect.runtime<never>()
    const run = Runtime.runCallback(runtime)
    let up = 0
    let down = 0
    let wakeReader: (() => void) | undefined
    let closing = false
    const closeChannel = () => {
      if (closing) return
      closing = true
      run(channel.close)
    }

    // Writes are queued and acknowledged at once while under WRITE_BUFFER bytes: node's TLS
    // hands a stream one write at a time, so waiting for each channel write would make the tunnel
    // latency-bound. One writer drains the queue, coalescing chunks into bigger channel writes.
    const queued: Array<Buffer> = []
    let queuedBytes = 0
    let writing = false
    let writeError: Error | undefined
    let blocked: ((error?: Error | null) => void) | undefined
    let finalCallback: ((error?: Error | null) => void) | undefined
    const release = () => {
      const callback = blocked
      if (callback !== undefined && (writeError !== undefined || queuedBytes < WRITE_BUFFER)) {
        blocked = undefined
        callback(writeError ?? null)
      }
      if (finalCallback !== undefined && !writing && (queued.length === 0 || writeError !== undefined)) {
        const done = finalCallback
        finalCallback = undefined
        closeChannel()
        done(writeError ?? null)
      }
    }
    const pumpWrites = () => {
      if (writing || queued.length === 0 || writeError !== undefined) return release()
      writing = true
      const batch: Array<Buffer> = []
      let size = 0
      while (queued.length > 0 && size < MAX_BATCH) {
        const next = queued.shift()!
        batch.push(next)
        size += next.length
      }
      const merged = batch.length === 1 ? batch[0]! : Buffer.concat(batch, size)
      run(channel.write(merged), {
        onExit: (exit) => {
          writing = false
          queuedBytes -= size
          if (Exit.isFailure(exit)) writeError = new Error("tunnel channel closed")
          pumpWrites()
          if (writeError !== undefined && !duplex.destroyed) duplex.destroy(writeError)
        }
      })
      release()
    }

    const duplex: Duplex = new Duplex({
      allowHalfOpen: false,
      readableHighWaterMark: READ_BUFFER,
      writableHighWaterMark: WRITE_BUFFER,
      read() {
        const wake = wakeReader
        wakeReader = undefined
        wake?.()
      },
      write(chunk: Buffer, _encoding, callback) {
        if (writeError !== undefined) return callback(writeError)
        down += chunk.length
        queued.push(chunk)
        queuedBytes += chunk.length
        blocked = callback
        pumpWrites()
      },
      final(callback) {
        finalCallback = callback
        pumpWrites()
      },
      destroy(error, callback) {
        closeChannel()
        const wake = wakeReader
        wakeReader = undefined
        wake?.()
        callback(error)
      }
    })

    const pushChunk = (chunk: Uint8Array) =>
      Effect.async<void>((resume) => {
        if (duplex.destroyed) return resume(Effect.void)
        up += chunk.length
        if (duplex.push(Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength))) resume(Effect.void)
        else wakeReader = () => resume(Effect.void)
      })

    const reader = yield* channel.read.pipe(
      Stream.runForEach((chunk) => pushChunk(chunk)),
      Effect.matchEffect({
        onFailure: () => Effect.sync(() => duplex.destroy()),
        onSuccess: () => Effect.sync(() => (duplex.destroyed ? undefined : duplex.push(null)))
      }),
      Effect.forkScoped
    )
    yield* Effect.addFinalizer(() =>
      Effect.sync(() => {
        if (!duplex.destroyed) duplex.destroy()
      }).pipe(Effect.zipRight(Fiber.interrupt(reader)))
    )
    const closed = Effect.async<void>((resume) => {
      if (duplex.closed) return resume(Effect.void)
      const done = () => resume(Effect.void)
      duplex.once("close", done)
      return Effect.sync(() => duplex.off("close", done))
    })
    return { duplex, bytesUp: () => up, bytesDown: () => down, closed }
  })
