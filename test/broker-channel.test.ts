import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import { channelDuplex } from "../src/broker/channel.js"
import { GuestDisconnected } from "../src/services/GuestRpc.js"

/** a channel whose writes complete on a later macrotask (like a real transport), recording everything */
const slowChannel = (failAfter = Infinity) => {
  const received: Array<Buffer> = []
  let inFlight = 0
  let maxInFlight = 0
  let closedAt: number | undefined
  const channel = {
    read: Stream.never as Stream.Stream<Uint8Array, GuestDisconnected>,
    write: (chunk: Uint8Array) =>
      Effect.async<void, GuestDisconnected>((resume) => {
        inFlight++
        maxInFlight = Math.max(maxInFlight, inFlight)
        setImmediate(() => {
          inFlight--
          if (received.length >= failAfter)
            return resume(Effect.fail(new GuestDisconnected({ message: "gone" })))
          received.push(Buffer.from(chunk))
          resume(Effect.void)
        })
      }),
    close: Effect.sync(() => {
      closedAt = received.reduce((n, b) => n + b.length, 0)
    })
  }
  return { channel, received, stats: () => ({ maxInFlight, closedAt }) }
}

describe("channelDuplex (tunnel channel ↔ node Duplex)", () => {
  it.scoped(
    "keeps order, coalesces, has one channel write in flight, and closes only after the last byte",
    () =>
      Effect.gen(function* () {
        const { channel, received, stats } = slowChannel()
        const bridge = yield* channelDuplex(channel)
        const chunks = Array.from({ length: 300 }, (_, i) => Buffer.alloc(1000 + (i % 7), i % 256))
        const total = chunks.reduce((n, c) => n + c.length, 0)
        yield* Effect.promise(
          () =>
            new Promise<void>((resolve) => {
              let i = 0
              const pump = () => {
                while (i < chunks.length)
                  if (!bridge.duplex.write(chunks[i++]!)) return void bridge.duplex.once("drain", pump)
                bridge.duplex.end(() => resolve())
              }
              pump()
            })
        )
        expect(Buffer.concat(received).equals(Buffer.concat(chunks))).toBe(true)
        expect(received.length).toBeLessThan(chunks.length) // coalesced
        expect(stats()).toEqual({ maxInFlight: 1, closedAt: total })
        expect(bridge.bytesDown()).toBe(total)
      })
  )

  it.scoped(
    "destroyed right after a write it called back on (node's TLS after its last record): the bytes still go out, then the close",
    () =>
      Effect.gen(function* () {
        const { channel, received, stats } = slowChannel()
        const bridge = yield* channelDuplex(channel)
        const last = Buffer.from("the end of a response, then close_notify")
        yield* Effect.promise(
          () =>
            new Promise<void>((resolve) => {
              bridge.duplex.write(Buffer.alloc(5000, 1))
              bridge.duplex.write(last, () => {
                bridge.duplex.destroy()
                bridge.duplex.once("close", () => resolve())
              })
            })
        )
        expect(Buffer.concat(received).subarray(5000).equals(last)).toBe(true)
        expect(stats().closedAt).toBe(5000 + last.length)
      })
  )

  it.scoped("a failed channel write destroys the duplex and fails later writes", () =>
    Effect.gen(function* () {
      const { channel } = slowChannel(1)
      const bridge = yield* channelDuplex(channel)
      const error = yield* Effect.promise(
        () =>
          new Promise<Error | undefined>((resolve) => {
            bridge.duplex.on("error", (e) => resolve(e))
            const big = Buffer.alloc(64 * 1024)
            for (let i = 0; i < 8; i++) bridge.duplex.write(big)
          })
      )
      expect(error?.message).toBe("tunnel channel closed")
      expect(bridge.duplex.destroyed).toBe(true)
    })
  )

  it.scoped("guest bytes arrive in order with backpressure; the end of the read stream ends the duplex", () =>
    Effect.gen(function* () {
      const parts = Array.from({ length: 100 }, (_, i) => new Uint8Array(8192).fill(i))
      const bridge = yield* channelDuplex({
        read: Stream.fromIterable(parts),
        write: () => Effect.void,
        close: Effect.void
      })
      const got = yield* Effect.promise(
        () =>
          new Promise<Buffer>((resolve) => {
            const seen: Array<Buffer> = []
            bridge.duplex.on("data", (c: Buffer) => seen.push(c))
            bridge.duplex.on("end", () => resolve(Buffer.concat(seen)))
          })
      )
      expect(got.equals(Buffer.concat(parts))).toBe(true)
      expect(bridge.bytesUp()).toBe(8192 * 100)
    })
  )
})
