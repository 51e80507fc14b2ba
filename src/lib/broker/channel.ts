import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Runtime from "effect/Runtime"
import type * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import { Duplex } from "node:stream"
import type { GuestDisconnected } from "../../services/GuestRpc.js"

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

    const duplex: Duplex = new Duplex({
      allowHalfOpen: false,
      read() {
        const wake = wakeReader
        wakeReader = undefined
        wake?.()
      },
      write(chunk: Buffer, _encoding, callback) {
        down += chunk.length
        run(channel.write(chunk), {
          onExit: (exit) => callback(Exit.isSuccess(exit) ? null : new Error("tunnel channel closed"))
        })
      },
      final(callback) {
        closeChannel()
        callback()
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
