import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
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
/** how long a destroyed duplex waits for its last bytes to go out (a guest that stops reading) */
const DESTROY_FLUSH_MS = 5_000

/**
 * A tunnel's channel once accepted: the seam between the broker and the host protocol. Bytes
 * from the guest as a Stream, bytes to the guest as a write, and `close` (the channel's end,
 * run once, by the scope the tunnel is served in). `TunnelRequest.accept` supplies one today;
 * any transport that gives a Stream in, a write out and a Scope can (see `serveChannel` in
 * HttpsBrokerLive.ts).
 */
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

/** a one-shot wake-up for a fiber waiting on node: `wait` suspends until `signal` (or returns at once if it came first) */
const makeSignal = () => {
  let signalled = false
  let waiter: (() => void) | undefined
  return {
    signal: () => {
      signalled = true
      const w = waiter
      waiter = undefined
      w?.()
    },
    wait: Effect.async<void>((resume) => {
      if (signalled) {
        signalled = false
        return resume(Effect.void)
      }
      waiter = () => {
        signalled = false
        resume(Effect.void)
      }
      return Effect.sync(() => {
        waiter = undefined
      })
    })
  }
}

/**
 * Bridge a tunnel channel to a node Duplex, with backpressure both ways. Two fibers in the given
 * scope run every channel effect: a reader pushes guest bytes and waits while node's buffer is
 * full; a writer takes what node wrote, coalesced, one channel write at a time, and closes the
 * channel after the last byte (or when the duplex is destroyed). Node's callbacks only queue and
 * wake them, so closing the scope interrupts both and nothing runs outside it.
 */
export const channelDuplex = (channel: TunnelChannel): Effect.Effect<ChannelDuplex, never, Scope.Scope> =>
  Effect.gen(function* () {
    let up = 0
    let down = 0
    let wakeReader: (() => void) | undefined
    const writerWake = makeSignal()

    // Writes are queued and acknowledged at once while under WRITE_BUFFER bytes: node's TLS
    // hands a stream one write at a time, so waiting for each channel write would make the tunnel
    // latency-bound. The writer fiber drains the queue, coalescing chunks into bigger writes.
    const queued: Array<Buffer> = []
    let queuedBytes = 0
    let writeError: Error | undefined
    let closeRequested = false
    let blocked: ((error?: Error | null) => void) | undefined
    let finalCallback: ((error?: Error | null) => void) | undefined
    /** a destroy without an error waits for the bytes already written (node called back on them) */
    let destroyCallback: (() => void) | undefined
    let aborted = false
    /** a batch taken from `queued` is being written */
    let writing = false
    const release = () => {
      const callback = blocked
      if (callback !== undefined && (writeError !== undefined || queuedBytes < WRITE_BUFFER)) {
        blocked = undefined
        callback(writeError ?? null)
      }
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
        release()
        writerWake.signal()
      },
      final(callback) {
        finalCallback = callback
        writerWake.signal()
      },
      destroy(error, callback) {
        closeRequested = true
        const wake = wakeReader
        wakeReader = undefined
        wake?.()
        // node's TLS destroys its transport right after its last write (close_notify included),
        // whose callback already ran: those bytes still go out before the channel closes
        if (error === null && (queued.length > 0 || writing) && writeError === undefined) {
          const timer = setTimeout(() => {
            aborted = true
            settleDestroy()
          }, DESTROY_FLUSH_MS)
          destroyCallback = () => {
            clearTimeout(timer)
            callback(null)
          }
        } else {
          aborted = true
          callback(error)
        }
        writerWake.signal()
      }
    })

    const takeBatch = () => {
      const batch: Array<Buffer> = []
      let size = 0
      while (queued.length > 0 && size < MAX_BATCH) {
        const next = queued.shift()!
        batch.push(next)
        size += next.length
      }
      return { merged: batch.length === 1 ? batch[0]! : Buffer.concat(batch, size), size }
    }

    let channelClosed = false
    const closeChannel = Effect.suspend(() => {
      if (channelClosed) return Effect.void
      channelClosed = true
      return channel.close
    })
    /** after the last byte (end) or at once (destroyed): the channel's close, then node's final callback */
    const finish = Effect.suspend(() => {
      const done = finalCallback
      finalCallback = undefined
      return Effect.as(closeChannel, done)
    }).pipe(
      Effect.map((done) => {
        done?.(writeError ?? null)
        settleDestroy()
      }),
      Effect.uninterruptible
    )
    const settleDestroy = () => {
      const callback = destroyCallback
      destroyCallback = undefined
      callback?.()
    }

    const writer: Effect.Effect<void> = Effect.gen(function* () {
      while (true) {
        if (writeError !== undefined || aborted || (closeRequested && queued.length === 0))
          return yield* finish
        if (queued.length > 0) {
          const { merged, size } = takeBatch()
          writing = true
          const exit = yield* Effect.exit(channel.write(merged))
          writing = false
          queuedBytes -= size
          if (Exit.isFailure(exit)) {
            writeError = new Error("tunnel channel closed")
            queued.length = 0
            release()
            if (!duplex.destroyed) duplex.destroy(writeError)
            return yield* finish
          }
          release()
          continue
        }
        if (finalCallback !== undefined) return yield* finish
        yield* writerWake.wait
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
    const writerFiber = yield* Effect.forkScoped(writer)
    yield* Effect.addFinalizer(() =>
      Effect.sync(() => {
        if (!duplex.destroyed) duplex.destroy()
      }).pipe(
        Effect.zipRight(Fiber.interrupt(reader)),
        // a write still in flight is interrupted; the channel is closed either way
        Effect.zipRight(Fiber.interrupt(writerFiber)),
        Effect.zipRight(closeChannel),
        Effect.zipRight(Effect.sync(() => settleDestroy()))
      )
    )
    const closed = Effect.async<void>((resume) => {
      if (duplex.closed) return resume(Effect.void)
      const done = () => resume(Effect.void)
      duplex.once("close", done)
      return Effect.sync(() => duplex.off("close", done))
    })
    return { duplex, bytesUp: () => up, bytesDown: () => down, closed }
  })
