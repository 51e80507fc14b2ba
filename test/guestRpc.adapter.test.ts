import type * as net from "node:net"
import { describe, expect, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import { encodeFrame, FrameKind } from "../src/protocol/Frame.js"
import type { ControlMessage } from "../src/protocol/Messages.js"
import { Mux } from "../src/protocol/Mux.js"
import * as MuxAdapter from "../src/layers/guestRpc/MuxAdapter.js"
import { unixSocketPairs } from "./support/socketPair.js"

const unixSocketPair = unixSocketPairs("abox-adapter-")

/** two ends of a real unix socket (host, peer), destroyed with the scope */
const socketPair = Effect.acquireRelease(
  Effect.promise(() => unixSocketPair()).pipe(
    Effect.map(([client, accepted]): [net.Socket, net.Socket] => [accepted, client])
  ),
  ([a, b]) =>
    Effect.sync(() => {
      a.destroy()
      b.destroy()
    })
)

const WINDOW = 1024

/** the host's adapter and a plain Mux peer (the guest's side), both with a small window */
const connected = Effect.gen(function* () {
  const [hostSocket, peerSocket] = yield* socketPair
  const link = yield* MuxAdapter.make(hostSocket, { maxControlQueue: 4, initialWindow: WINDOW })
  const peer = new Mux(peerSocket, { initialWindow: WINDOW })
  peer.onError(() => undefined)
  const received: Array<ControlMessage> = []
  peer.onControl((m) => void received.push(m))
  return { link, peer, received }
})

/** a control message there and its echo back: every frame written before it has arrived */
const roundTrip = (link: MuxAdapter.HostMux, peer: Mux, received: Array<ControlMessage>) =>
  Effect.gen(function* () {
    const before = received.length
    yield* link.send({ type: "cancel", turn: 999 })
    yield* Effect.promise(
      () =>
        new Promise<void>((resolve) => {
          const check = () => (received.length > before ? resolve() : setImmediate(check))
          check()
        })
    )
    void peer
  })

/** the peer opens tunnel 1; the host takes its end once tunnel_open has arrived (as the host does) */
const guestOpens = (link: MuxAdapter.HostMux, peer: Mux) =>
  Effect.gen(function* () {
    yield* Effect.promise(() => peer.sendControl({ type: "tunnel_open", channel: 1, host: "h", port: 1 }))
    const [open] = Chunk.toReadonlyArray(yield* Stream.runCollect(Stream.take(link.control, 1)))
    expect(open?.type).toBe("tunnel_open")
    return yield* link.channel(1)
  })

const bytes = (n: number, fill = 7) => new Uint8Array(n).fill(fill)

describe("MuxAdapter (the host's Effect view of a Mux)", () => {
  it.live("control is a Stream of the peer's messages in order; it ends when the connection closes", () =>
    Effect.gen(function* () {
      const { link, peer } = yield* connected
      const collected = yield* Stream.runCollect(link.control).pipe(Effect.fork)
      yield* Effect.promise(() =>
        peer.sendControl({ type: "hello", protocol: 4, arch: "x86_64", build: "t" })
      )
      yield* Effect.promise(() => peer.sendControl({ type: "ready" }))
      peer.close()
      const messages = Chunk.toReadonlyArray(yield* Fiber.join(collected))
      expect(messages.map((m) => m.type)).toEqual(["hello", "ready"])
      yield* link.closed
      expect(link.isOpen()).toBe(false)
    }).pipe(Effect.scoped)
  )

  it.live("a protocol violation fails control with ProtocolError after the messages before it", () =>
    Effect.gen(function* () {
      const [hostSocket, peerSocket] = yield* socketPair
      const link = yield* MuxAdapter.make(hostSocket, { maxControlQueue: 4 })
      const peer = new Mux(peerSocket)
      peer.onError(() => undefined)
      yield* Effect.promise(() => peer.sendControl({ type: "ready" }))
      // DATA on a channel nobody opened
      peerSocket.write(encodeFrame({ channel: 9, kind: FrameKind.Data, payload: bytes(3) }))
      const seen: Array<string> = []
      const error = yield* Stream.runForEach(link.control, (m) => Effect.sync(() => seen.push(m.type))).pipe(
        Effect.flip
      )
      expect(seen).toEqual(["ready"])
      expect(error._tag).toBe("ProtocolError")
      expect(error.message).toMatch(/unopened channel 9/)
    }).pipe(Effect.scoped)
  )

  it.live("a channel's read and sink: bytes both ways with EOF, credit returned as the reader pulls", () =>
    Effect.gen(function* () {
      const { link, peer } = yield* connected
      const channel = yield* link.channel(2)
      yield* link.send({ type: "transfer_begin", channel: 2, format: "tar", target: "/x" })
      // host → peer: 8 windows through the sink, then EOF
      const sent = yield* Stream.range(1, 8).pipe(
        Stream.map((i) => bytes(WINDOW, i)),
        Stream.run(channel.sink),
        Effect.fork
      )
      const peerChannel = yield* Effect.promise(async () => {
        while (peer.liveChannels === 0) await new Promise((r) => setImmediate(r))
        return peer.channel(2)
      })
      const got = yield* Effect.promise(async () => {
        let n = 0
        for await (const chunk of peerChannel.readable) n += chunk.length
        return n
      })
      yield* Fiber.join(sent)
      expect(got).toBe(8 * WINDOW)
      // peer → host: more than a window, read through the Stream to the peer's EOF
      const peerWrites = Effect.promise(async () => {
        for (let i = 0; i < 5; i++) await peerChannel.write(bytes(WINDOW))
        await peerChannel.end()
      })
      const [, read] = yield* Effect.all(
        [peerWrites, Stream.runFold(channel.read, 0, (n, c) => n + c.length)],
        {
          concurrency: 2
        }
      )
      expect(read).toBe(5 * WINDOW)
    }).pipe(Effect.scoped)
  )

  it.live("back pressure: a write waits for the peer's credit, and goes on when the peer reads", () =>
    Effect.gen(function* () {
      const { link, peer, received } = yield* connected
      const channel = yield* link.channel(2)
      yield* link.send({ type: "transfer_begin", channel: 2, format: "tar", target: "/x" })
      const writing = yield* channel.write(bytes(4 * WINDOW)).pipe(Effect.fork)
      // every frame the write could send has arrived once a later control message has
      yield* roundTrip(link, peer, received)
      const peerChannel = peer.channel(2)
      expect(Option.isNone(yield* Fiber.poll(writing))).toBe(true)
      const iterator = peerChannel.readable[Symbol.asyncIterator]()
      let got = 0
      while (got < 4 * WINDOW) {
        const next = yield* Effect.promise(() => iterator.next())
        got += next.value!.length
        // the peer never holds more than its window (the Mux would fail the connection)
        expect(next.value!.length).toBeLessThanOrEqual(WINDOW)
      }
      yield* Fiber.join(writing)
      expect(got).toBe(4 * WINDOW)
    }).pipe(Effect.scoped)
  )

  it.live("back pressure on reads: an unread channel stops the peer after one window", () =>
    Effect.gen(function* () {
      const { link, peer } = yield* connected
      const channel = yield* guestOpens(link, peer)
      const peerChannel = peer.channel(1)
      let written = false
      const peerWrites = peerChannel.write(bytes(3 * WINDOW)).then(() => {
        written = true
      })
      // a control message after the write: every DATA frame the peer could send came before it
      void peer.sendControl({ type: "ready" })
      const messages = Chunk.toReadonlyArray(yield* Stream.runCollect(Stream.take(link.control, 1)))
      expect(messages.map((m) => m.type)).toEqual(["ready"])
      // the peer waits for credit, which the host gives only as it reads
      expect(written).toBe(false)
      const reading = yield* Stream.runFold(channel.read, 0, (n, c) => n + c.length).pipe(Effect.fork)
      yield* Effect.promise(() => peerWrites)
      yield* Effect.promise(() => peerChannel.end())
      expect(yield* Fiber.join(reading)).toBe(3 * WINDOW)
    }).pipe(Effect.scoped)
  )

  it.live(
    "closing a channel's Scope resets it: a pending read and a later write fail, late DATA is dropped",
    () =>
      Effect.gen(function* () {
        const { link, peer, received } = yield* connected
        const channelScope = yield* Scope.make()
        const channel = yield* Scope.extend(guestOpens(link, peer), channelScope)
        const reading = yield* Stream.runDrain(channel.read).pipe(Effect.fork)
        yield* Scope.close(channelScope, Exit.void)
        const readExit = yield* Fiber.await(reading)
        expect(Exit.isFailure(readExit)).toBe(true)
        const writeError = yield* channel.write(bytes(10)).pipe(Effect.flip)
        expect(writeError._tag).toBe("GuestDisconnected")
        // the peer still sends on it: dropped, and the connection is fine
        yield* Effect.promise(() => peer.channel(1).write(bytes(10)))
        yield* roundTrip(link, peer, received)
        expect(link.isOpen()).toBe(true)
        expect(peer.failure).toBeUndefined()
      }).pipe(Effect.scoped)
  )

  it.live("interruption: a read waiting for bytes and a write waiting for credit end at once", () =>
    Effect.gen(function* () {
      const { link, peer } = yield* connected
      const channel = yield* guestOpens(link, peer)
      const reading = yield* Stream.runDrain(channel.read).pipe(Effect.fork)
      const writing = yield* channel.write(bytes(8 * WINDOW)).pipe(Effect.fork)
      yield* Effect.yieldNow()
      // neither can finish: the peer sends nothing and reads nothing
      yield* Fiber.interrupt(reading)
      yield* Fiber.interrupt(writing)
      expect(Exit.isInterrupted(yield* Fiber.await(reading))).toBe(true)
      expect(Exit.isInterrupted(yield* Fiber.await(writing))).toBe(true)
      // an interrupted read resets the channel (its bytes in flight would be lost otherwise)
      expect((yield* channel.write(bytes(1)).pipe(Effect.flip))._tag).toBe("GuestDisconnected")
      // and the connection goes on
      yield* Effect.promise(() => peer.sendControl({ type: "ready" }))
      const [next] = Chunk.toReadonlyArray(yield* Stream.runCollect(Stream.take(link.control, 1)))
      expect(next?.type).toBe("ready")
    }).pipe(Effect.scoped)
  )

  it.live("closing the connection's Scope destroys the Mux: the peer sees the close", () =>
    Effect.gen(function* () {
      const scope = yield* Scope.make()
      const { peer } = yield* Scope.extend(connected, scope)
      const peerClosed = new Promise<void>((resolve) => peer.onClose(resolve))
      yield* Scope.close(scope, Exit.void)
      yield* Effect.promise(() => peerClosed)
      expect(peer.isClosed).toBe(true)
    })
  )
})
