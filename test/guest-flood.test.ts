/**
 * A hostile guest floods the host with tunnel_open frames (protocol v4 spoken on rpc.sock by a
 * replaced guest agent). The host must read them no faster than it can refuse them: bounded
 * queues, at most maxTunnels broker fibers, the socket paused meanwhile; then it answers every
 * one and stays responsive. (Memory is sampled from the heap as it is, garbage included.)
 */
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { mkdtempSync, readFileSync, rmSync } from "node:fs"
import * as net from "node:net"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll, describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import { decodePolicy } from "../src/broker/policy.js"
import { GuestRpcLive } from "../src/layers/GuestRpcLive.js"
import { makeHttpsBroker } from "../src/broker/HttpsBrokerLive.js"
import { encodeFrame, FrameKind } from "../src/protocol/Frame.js"
import type { ControlMessage } from "../src/protocol/Messages.js"
import { encodeControlPayload, Mux } from "../src/protocol/Mux.js"
import { GuestRpc, type TunnelRequest } from "../src/services/GuestRpc.js"

const dir = mkdtempSync(join(tmpdir(), "abox-flood-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const FLOOD = 20_000
const MiB = 1024 * 1024
const sleep = (ms: number) => Effect.promise(() => new Promise((r) => setTimeout(r, ms)))

describe("a guest that floods tunnel_open", () => {
  it.live(
    `${FLOOD} tunnel_open frames: bounded reading while refusals back up, every one refused, the host stays responsive`,
    () =>
      Effect.gen(function* () {
        const socketPath = join(dir, "rpc.sock")
        const rpc = yield* GuestRpc
        const { accept } = yield* rpc.listen(socketPath, {
          helloTimeout: "20 seconds",
          shutdownTimeout: "20 seconds"
        })

        // the hostile guest: a real Mux for the handshake and the answers, raw frames for the flood
        const socket = net.connect(socketPath)
        yield* Effect.async<void>((resume) => void socket.once("connect", () => resume(Effect.void)))
        const guest = new Mux(socket)
        guest.onError(() => undefined)
        let denied = 0
        guest.onControl((m: ControlMessage) => {
          if (m.type === "tunnel_deny") denied++
          if (m.type === "user_turn")
            return guest.sendControl({
              type: "turn_end",
              turn: m.turn,
              exitCode: 0,
              signal: null,
              cancelled: false
            })
          if (m.type === "shutdown") guest.close()
        })
        void guest.sendControl({
          type: "hello",
          protocol: 4,
          arch: "x86_64",
          build: "hostile",
          contextTurns: 0
        })
        void guest.sendControl({ type: "ready" })
        const conn = yield* accept

        const broker = yield* makeHttpsBroker({})
        const sessionDir = mkdtempSync(join(dir, "session-"))
        const policy = yield* decodePolicy({ format: 1, allow: [] })
        const session = yield* broker.make(policy, { sessionId: "s-flood", sessionDir })
        yield* Effect.forkScoped(session.serve(conn.tunnels))

        // the heap as it is (garbage included): a fixed ceiling whatever the collector does
        const heap = () => process.memoryUsage().heapUsed
        const baseline = heap()
        let peak = baseline
        const sampler = setInterval(() => {
          peak = Math.max(peak, heap())
        }, 50)
        yield* Effect.addFinalizer(() => Effect.sync(() => clearInterval(sampler)))

        const frames: Array<Uint8Array> = []
        for (let i = 0; i < FLOOD; i++) {
          const message: ControlMessage = {
            type: "tunnel_open",
            channel: 2 * i + 1,
            host: "h.test",
            port: 443
          }
          frames.push(
            encodeFrame({ channel: 0, kind: FrameKind.Control, payload: encodeControlPayload(message) })
          )
        }
        const flood = Buffer.concat(frames)
        // the guest floods and reads nothing back: the host's refusals back up in the socket
        socket.pause()
        // in small writes, so that writableLength tells what the host has not taken yet
        for (let at = 0; at < flood.length; at += 8192) socket.write(flood.subarray(at, at + 8192))

        // once its refusals cannot be sent, the host stops reading: most of the flood stays in
        // the guest's own socket buffer (the host reads what its bounded queues and the socket's
        // buffers hold, not 20,000 requests with a fiber each)
        let last = -1
        for (let i = 0; i < 100 && socket.writableLength !== last; i++) {
          last = socket.writableLength
          yield* sleep(200)
        }
        console.error(
          `flood: host took ${flood.length - socket.writableLength} of ${flood.length} bytes while the guest did not read`
        )
        expect(socket.writableLength).toBeGreaterThan(flood.length / 4)
        expect(yield* session.active).toBeLessThanOrEqual(64)

        // the guest reads again: every request is refused and logged, in bounded memory
        socket.resume()
        for (let i = 0; i < 600 && denied < FLOOD; i++) yield* sleep(100)
        expect(denied).toBe(FLOOD)
        expect(peak - baseline).toBeLessThan(192 * MiB)
        // the refusals are in broker.log (repeated denials are summarised: a bounded log)
        const log = readFileSync(join(sessionDir, "broker.log"), "utf8")
        expect(log).toContain("h.test")
        expect(log.length).toBeLessThan(MiB)
        console.error(
          `flood: ${FLOOD} refused; heap peak ${((peak - baseline) / MiB).toFixed(1)} MiB above baseline`
        )

        // and the connection still works
        const events = yield* Stream.runCollect(conn.turn("true"))
        expect([...events].at(-1)).toMatchObject({ _tag: "End", exitCode: 0 })
      }).pipe(Effect.scoped, Effect.provide(GuestRpcLive), Effect.provide(NodeFileSystem.layer)),
    120_000
  )

  it.scoped(
    "the broker serves a stream of requests with at most maxTunnels + 1 in hand, whatever their number",
    () =>
      Effect.gen(function* () {
        const broker = yield* makeHttpsBroker({ maxTunnels: 8 })
        const policy = yield* decodePolicy({ format: 1, allow: [] })
        const session = yield* broker.make(policy, {
          sessionId: "s-bound",
          sessionDir: mkdtempSync(join(dir, "s-"))
        })
        let inHand = 0
        let taken = 0
        // refusals that never complete (a guest that reads nothing back)
        const requests = Stream.range(1, 1000).pipe(
          Stream.tap(() => Effect.sync(() => taken++)),
          Stream.map((i): TunnelRequest => ({
            channel: 2 * i - 1,
            host: "h.test",
            port: 443,
            accept: () => Effect.die("not accepted"),
            deny: () =>
              Effect.zipRight(
                Effect.sync(() => inHand++),
                Effect.never
              )
          }))
        )
        yield* Effect.forkScoped(session.serve(requests))
        yield* sleep(300)
        expect(inHand).toBe(9)
        expect(taken).toBeLessThanOrEqual(10)
      }).pipe(Effect.provide(NodeFileSystem.layer))
  )
})
