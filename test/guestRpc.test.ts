import { spawnSync } from "node:child_process"
import { mkdtempSync, rmSync, statSync } from "node:fs"
import * as net from "node:net"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll, describe, expect, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as TestClock from "effect/TestClock"
import { encodeFrame, FrameKind } from "../src/protocol/Frame.js"
import type { ControlMessage } from "../src/protocol/Messages.js"
import { Mux } from "../src/protocol/Mux.js"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { GuestRpc, type GuestRpcOptions } from "../src/services/GuestRpc.js"

const dir = mkdtempSync(join(tmpdir(), "abox-rpc-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))
let counter = 0
const socketPath = () => join(dir, `rpc${counter++}.sock`)
const options = { helloTimeout: "5 seconds", shutdownTimeout: "5 seconds" } as const

const realDelay = (ms: number) => Effect.promise(() => new Promise((r) => setTimeout(r, ms)))

interface FakeGuest {
  readonly mux: Mux
  readonly socket: net.Socket
  readonly received: Array<ControlMessage>
  readonly closed: Promise<void>
}

/** a scripted guest written with Frame/Mux over a real unix socket */
const fakeGuest = (
  path: string,
  script: (guest: FakeGuest, message: ControlMessage) => void | Promise<void>,
  hello: { readonly protocol?: number; readonly skipReady?: boolean; readonly silent?: boolean } = {}
): Promise<FakeGuest> =>
  new Promise((resolve, reject) => {
    const socket = net.connect(path)
    socket.once("error", reject)
    socket.once("connect", () => {
      const mux = new Mux(socket)
      const guest: FakeGuest = {
        mux,
        socket,
        received: [],
        closed: new Promise((r) => mux.onClose(r))
      }
      mux.onControl((m) => {
        guest.received.push(m)
        if (m.type === "shutdown") {
          mux.close()
          return
        }
        return script(guest, m)
      })
      mux.onError(() => undefined)
      if (!hello.silent) {
        void mux.sendControl({
          type: "hello",
          protocol: hello.protocol ?? 4,
          arch: "x86_64",
          build: "fake",
          contextTurns: 0
        })
        if (!hello.skipReady) void mux.sendControl({ type: "ready" })
      }
      resolve(guest)
    })
  })

const listen = (path: string, opts: GuestRpcOptions = options) =>
  Effect.flatMap(GuestRpc, (rpc) => rpc.listen(path, opts))

const provide = Effect.provide(GuestRpcLive)

describe("GuestRpcLive over a real unix socket", () => {
  it.live(
    "binds 0600, hello/ready, and the connection's finalizer sends shutdown and waits for the close",
    () =>
      Effect.gen(function* () {
        const path = socketPath()
        const outer = yield* Scope.make()
        const { accept } = yield* Scope.extend(listen(path), outer)
        expect(statSync(path).mode & 0o777).toBe(0o600)
        const guestP = fakeGuest(path, () => undefined)
        const inner = yield* Scope.make()
        const conn = yield* Scope.extend(accept, inner)
        expect(conn.hello).toMatchObject({ type: "hello", protocol: 4, arch: "x86_64" })
        const guest = yield* Effect.promise(() => guestP)
        yield* Scope.close(inner, Exit.void)
        expect(guest.received.map((m) => m.type)).toEqual(["shutdown"])
        yield* Effect.promise(() => guest.closed)
        yield* Scope.close(outer, Exit.void)
        expect(() => statSync(path)).toThrow()
      }).pipe(provide)
  )

  it.live(
    "a connection that ends before its hello is dropped and the next one taken (vfkit: each guest connect is a new connection)",
    () =>
      Effect.gen(function* () {
        const path = socketPath()
        const { accept } = yield* listen(path)
        // a guest connect whose bytes never came (vfkit dialled rpc.sock, the guest's side went)
        const dead = net.connect(path)
        yield* Effect.promise(() => new Promise<void>((resolve) => dead.once("connect", () => resolve())))
        dead.end()
        const acceptF = yield* Effect.fork(accept)
        yield* realDelay(100)
        const guestP = fakeGuest(path, () => undefined)
        const conn = yield* Fiber.join(acceptF)
        expect(conn.hello).toMatchObject({ type: "hello", protocol: 4 })
        yield* Effect.promise(() => guestP)
      }).pipe(Effect.scoped, provide)
  )

  it.scoped("connections that all end before a hello: GuestTimeout saying so (TestClock)", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* listen(path)
      const fiber = yield* Effect.fork(Effect.scoped(accept))
      for (let i = 0; i < 2; i++) {
        const dead = net.connect(path)
        yield* Effect.promise(() => new Promise<void>((resolve) => dead.once("connect", () => resolve())))
        dead.destroy()
      }
      yield* realDelay(100)
      yield* TestClock.adjust("5 seconds")
      const error = yield* Fiber.join(fiber).pipe(Effect.flip)
      expect(error).toMatchObject({ _tag: "GuestTimeout", waitingFor: "hello" })
      expect(error.message).toMatch(/2 connections ended before a hello/)
    }).pipe(provide)
  )

  it.live("a connection never accepted (a VM whose restore failed) does not hold up the listener's close", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const scope = yield* Scope.make()
      yield* listen(path).pipe(Scope.extend(scope))
      // the VMM connects (QEMU's chardev at its start); nobody accepts: the open gives up
      const client = net.connect(path)
      client.on("error", () => undefined)
      yield* Effect.promise(() => new Promise<void>((r) => client.once("connect", () => r())))
      yield* realDelay(50)
      const closed = yield* Scope.close(scope, Exit.void).pipe(Effect.timeoutOption("10 seconds"))
      client.destroy()
      expect(closed._tag).toBe("Some")
    }).pipe(provide)
  )

  it.live("unlinks a stale socket file, refuses one that something listens on", () =>
    Effect.gen(function* () {
      const path = socketPath()
      // something listens: refused, and the file is left alone
      const live = net.createServer()
      yield* Effect.promise(() => new Promise<void>((r) => live.listen(path, r)))
      const busy = yield* Effect.scoped(listen(path)).pipe(Effect.flip)
      expect(busy._tag).toBe("GuestDisconnected")
      expect(busy.message).toMatch(/another process is listening/)
      yield* Effect.promise(() => new Promise<void>((r) => live.close(() => r())))
      // a stale file: a process that bound the path and was killed (no unlink)
      spawnSync(process.execPath, [
        "-e",
        `require("node:net").createServer().listen(${JSON.stringify(path)}, () => process.kill(process.pid, "SIGKILL"))`
      ])
      expect(statSync(path).isSocket()).toBe(true)
      yield* Effect.scoped(
        Effect.gen(function* () {
          const { accept } = yield* listen(path)
          const guestP = fakeGuest(path, () => undefined)
          const conn = yield* accept
          expect(conn.hello.protocol).toBe(4)
          yield* Effect.promise(() => guestP)
        })
      )
    }).pipe(provide)
  )

  it.live("an old guest gets GuestTooOld with the fix; a newer one GuestTooNew", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* listen(path)
      const old = fakeGuest(path, () => undefined, { protocol: 3 })
      const tooOld = yield* Effect.scoped(accept).pipe(Effect.flip)
      expect(tooOld._tag).toBe("GuestTooOld")
      expect(tooOld.message).toMatch(/run image-update, then open a new session/)
      const oldGuest = yield* Effect.promise(() => old)
      yield* Effect.promise(() => oldGuest.closed)
      expect(oldGuest.received).toMatchObject([{ type: "error", code: "protocol_unsupported" }])

      void fakeGuest(path, () => undefined, { protocol: 5 })
      const tooNew = yield* Effect.scoped(accept).pipe(Effect.flip)
      expect(tooNew).toMatchObject({ _tag: "GuestTooNew", protocol: 5, maximum: 4 })
    }).pipe(Effect.scoped, provide)
  )

  it.live("a malformed frame is a ProtocolError", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* listen(path)
      const raw = net.connect(path)
      raw.write(Buffer.from("GET / HTTP/1.1\r\nHost: x\r\n\r\n"))
      const error = yield* Effect.scoped(accept).pipe(Effect.flip)
      expect(error._tag).toBe("ProtocolError")
      raw.destroy()

      const raw2 = net.connect(path)
      raw2.write(
        encodeFrame({ channel: 0, kind: FrameKind.Control, payload: Buffer.from('{"type":"ready"}') })
      )
      const early = yield* Effect.scoped(accept).pipe(Effect.flip)
      expect(early).toMatchObject({ _tag: "ProtocolError", reason: "expected hello, got ready" })
      raw2.destroy()
    }).pipe(Effect.scoped, provide)
  )

  it.scoped("a silent guest (or none) gives GuestTimeout, driven by the TestClock", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* listen(path)
      // nobody connects
      const none = yield* Effect.fork(Effect.scoped(accept))
      yield* realDelay(20)
      yield* TestClock.adjust("5 seconds")
      const e1 = yield* Fiber.join(none).pipe(Effect.flip)
      expect(e1).toMatchObject({ _tag: "GuestTimeout", waitingFor: "hello" })
      expect(e1.message).toMatch(/did not connect/)
      // connects, says nothing
      const silent = yield* Effect.promise(() => fakeGuest(path, () => undefined, { silent: true }))
      const fiber = yield* Effect.fork(Effect.scoped(accept))
      yield* realDelay(20)
      yield* TestClock.adjust("5 seconds")
      const e2 = yield* Fiber.join(fiber).pipe(Effect.flip)
      expect(e2).toMatchObject({ _tag: "GuestTimeout", waitingFor: "hello" })
      expect(e2.message).toMatch(/sent no hello/)
      yield* Effect.promise(() => silent.closed)
      // hello but no ready
      yield* Effect.promise(() => fakeGuest(path, () => undefined, { skipReady: true }))
      const f3 = yield* Effect.fork(Effect.scoped(accept))
      yield* realDelay(20)
      yield* TestClock.adjust("5 seconds")
      expect(yield* Fiber.join(f3).pipe(Effect.flip)).toMatchObject({
        _tag: "GuestTimeout",
        waitingFor: "ready"
      })
    }).pipe(provide)
  )

  it.scoped(
    "a guest that reads a transfer to its EOF and never sends transfer_end: GuestTimeout (TestClock)",
    () =>
      Effect.gen(function* () {
        const path = socketPath()
        const { accept } = yield* listen(path, { ...options, transferEndTimeout: "30 seconds" })
        const guestP = fakeGuest(path, (guest, m) => {
          // drain the tar, then say nothing
          if (m.type === "transfer_begin")
            void (async () => {
              for await (const _ of guest.mux.channel(m.channel).readable);
            })()
        })
        const conn = yield* accept
        yield* Effect.promise(() => guestP)
        const f = yield* Effect.fork(conn.transfer(Stream.make(new Uint8Array(1000)), "/work/repo"))
        yield* realDelay(100)
        yield* TestClock.adjust("29 seconds")
        yield* realDelay(20)
        expect(f.unsafePoll()).toBeNull()
        yield* TestClock.adjust("1 second")
        expect(yield* Fiber.join(f).pipe(Effect.flip)).toMatchObject({
          _tag: "GuestTimeout",
          waitingFor: "transfer_end"
        })
      }).pipe(provide)
  )

  it.live(
    "output events carry their exact bytes: base64 from a current guest, UTF-8 of data from an old one",
    () =>
      Effect.gen(function* () {
        const path = socketPath()
        const { accept } = yield* listen(path)
        const binary = Buffer.from([0xff, 0x00, 0xfe, 0x41])
        const guestP = fakeGuest(path, async (guest, m) => {
          if (m.type !== "user_turn") return
          const event = (e: Extract<ControlMessage, { type: "agent_event" }>["event"]) =>
            guest.mux.sendControl({ type: "agent_event", turn: m.turn, event: e })
          await event({ kind: "stdout", data: "\ufffd\u0000\ufffdA", base64: binary.toString("base64") })
          await event({ kind: "stderr", data: "h\u00e9llo" }) // an old guest: no base64
          await event({ kind: "status", message: "note" })
          await guest.mux.sendControl({
            type: "turn_end",
            turn: m.turn,
            exitCode: 0,
            signal: null,
            cancelled: false
          })
        })
        const conn = yield* accept
        yield* Effect.promise(() => guestP)
        const events = Chunk.toReadonlyArray(yield* Stream.runCollect(conn.turn("x")))
        const [out, err, status] = events
        expect(out).toMatchObject({ _tag: "Event", event: { kind: "stdout", data: "\ufffd\u0000\ufffdA" } })
        expect(Buffer.from((out as { bytes: Uint8Array }).bytes).equals(binary)).toBe(true)
        expect(Buffer.from((err as { bytes: Uint8Array }).bytes).toString("utf8")).toBe("h\u00e9llo")
        expect(status).toEqual({ _tag: "Event", event: { kind: "status", message: "note" } })
      }).pipe(Effect.scoped, provide)
  )

  it.live("a guest's error text reaches the host's errors with its control characters escaped", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* listen(path)
      const forged = 'x\n{"type":"End","exitCode":0}\u001b[2J\u009b31m'
      const guestP = fakeGuest(path, (guest, m) => {
        if (m.type === "user_turn")
          void guest.mux.sendControl({ type: "error", code: "bad\r", message: forged, turn: m.turn })
      })
      const conn = yield* accept
      yield* Effect.promise(() => guestP)
      const error = yield* Stream.runDrain(conn.turn("x")).pipe(Effect.flip)
      expect(error._tag).toBe("ProtocolError")
      expect(error.message).not.toMatch(/[\u0000-\u001f\u007f-\u009f]/)
      expect(error.message).toContain('x\\n{"type":"End","exitCode":0}\\e[2J\\x9b31m')
      expect((error as { reason: string }).reason).toBe("bad\\r")
    }).pipe(Effect.scoped, provide)
  )

  it.scoped("a guest that ignores shutdown: the bounded wait ends with GuestTimeout (TestClock)", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* listen(path)
      const guestP = fakeGuest(path, () => undefined)
      const conn = yield* accept
      const guest = yield* Effect.promise(() => guestP)
      // the guest stops answering: swallow shutdown without closing
      guest.mux.onControl((m) => void guest.received.push(m))
      const f = yield* Effect.fork(conn.shutdown)
      yield* realDelay(20)
      yield* TestClock.adjust("5 seconds")
      expect(yield* Fiber.join(f).pipe(Effect.flip)).toMatchObject({
        _tag: "GuestTimeout",
        waitingFor: "shutdown"
      })
      expect(guest.received.map((m) => m.type)).toContain("shutdown")
      guest.mux.destroy()
    }).pipe(provide)
  )

  it.live("transfer: streams a tar with flow control and returns transfer_end's figures", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* listen(path)
      const guestP = fakeGuest(path, async (g, m) => {
        if (m.type !== "transfer_begin") return
        let bytes = 0
        for await (const chunk of g.mux.channel(m.channel).readable) bytes += chunk.length
        await g.mux.sendControl({ type: "transfer_end", channel: m.channel, files: 7, bytes })
      })
      const conn = yield* accept
      const size = 5 * 1024 * 1024 + 3
      const tar = Stream.range(0, 80).pipe(Stream.map(() => new Uint8Array(Math.ceil(size / 81))))
      const total = Math.ceil(size / 81) * 81
      const result = yield* conn.transfer(tar, "/work/repo")
      expect(result).toEqual({ files: 7, bytes: total })
      const guest = yield* Effect.promise(() => guestP)
      expect(guest.received[0]).toEqual({
        type: "transfer_begin",
        channel: 2,
        format: "tar",
        target: "/work/repo"
      })
      // a refusal from the guest is TransferFailed
      guest.mux.onControl((m) => {
        if (m.type === "transfer_begin") {
          void guest.mux.sendControl({
            type: "error",
            code: "transfer_failed",
            message: "tar: bad header",
            channel: m.channel
          })
        }
        if (m.type === "shutdown") guest.mux.close()
      })
      const failed = yield* conn.transfer(Stream.make(new Uint8Array(10)), "/work/repo").pipe(Effect.flip)
      expect(failed).toMatchObject({ _tag: "TransferFailed", reason: "transfer_failed" })
    }).pipe(Effect.scoped, provide)
  )

  it.live(
    "transfer to a guest that stops reading waits with bounded memory, then fails cleanly on disconnect",
    () =>
      Effect.gen(function* () {
        const path = socketPath()
        const { accept } = yield* listen(path)
        const guestP = fakeGuest(path, () => undefined) // never reads the channel
        const conn = yield* accept
        const guest = yield* Effect.promise(() => guestP)
        let produced = 0
        const tar = Stream.repeatEffect(
          Effect.sync(() => {
            produced += 64 * 1024
            return new Uint8Array(64 * 1024)
          })
        ).pipe(Stream.take(1600)) // 100 MiB
        const fiber = yield* Effect.fork(conn.transfer(tar, "/work/repo"))
        yield* realDelay(300)
        expect(fiber.unsafePoll()).toBeNull()
        // the producer is held back by credit: one window plus a chunk or two, not 100 MiB
        expect(produced).toBeLessThanOrEqual(256 * 1024 + 4 * 64 * 1024)
        guest.socket.destroy()
        const error = yield* Fiber.join(fiber).pipe(Effect.flip)
        expect(error._tag).toBe("GuestDisconnected")
      }).pipe(Effect.scoped, provide)
  )

  it.live("turn: events stream in order and end with End; interrupting the stream sends cancel", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* listen(path)
      const timers = new Set<NodeJS.Timeout>()
      const guestP = fakeGuest(path, async (g, m) => {
        if (m.type === "user_turn" && m.text === "echo hi") {
          await g.mux.sendControl({
            type: "agent_event",
            turn: m.turn,
            event: { kind: "stdout", data: "hi\n" }
          })
          await g.mux.sendControl({
            type: "agent_event",
            turn: m.turn,
            event: { kind: "json", value: { a: [1] } }
          })
          await g.mux.sendControl({
            type: "turn_end",
            turn: m.turn,
            exitCode: 0,
            signal: null,
            cancelled: false
          })
        } else if (m.type === "user_turn") {
          const t = setInterval(
            () =>
              void g.mux
                .sendControl({ type: "agent_event", turn: m.turn, event: { kind: "stdout", data: "." } })
                .catch(() => undefined),
            5
          )
          timers.add(t)
        } else if (m.type === "cancel") {
          timers.forEach((t) => clearInterval(t))
          await g.mux.sendControl({
            type: "turn_end",
            turn: m.turn,
            exitCode: null,
            signal: "SIGTERM",
            cancelled: true
          })
        }
      })
      const conn = yield* accept
      const events = Chunk.toReadonlyArray(yield* Stream.runCollect(conn.turn("echo hi")))
      expect(events).toEqual([
        { _tag: "Event", event: { kind: "stdout", data: "hi\n" }, bytes: new TextEncoder().encode("hi\n") },
        { _tag: "Event", event: { kind: "json", value: { a: [1] } } },
        { _tag: "End", exitCode: 0, signal: null, cancelled: false }
      ])
      const three = yield* Stream.runCollect(conn.turn("sleep 100").pipe(Stream.take(3)))
      expect(Chunk.size(three)).toBe(3)
      const guest = yield* Effect.promise(() => guestP)
      yield* realDelay(50)
      expect(guest.received.filter((m) => m.type !== "agent_event").map((m) => m.type)).toEqual([
        "user_turn",
        "user_turn",
        "cancel"
      ])
      expect(guest.received[0]).toEqual({ type: "user_turn", turn: 1, text: "echo hi" })
      expect(guest.received[2]).toEqual({ type: "cancel", turn: 2 })
      timers.forEach((t) => clearInterval(t))
    }).pipe(Effect.scoped, provide)
  )

  it.live("a slow turn consumer: events back up through the bounded queues and all arrive in order", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* listen(path)
      const N = 3000
      void fakeGuest(path, (g, m) => {
        if (m.type !== "user_turn") return
        for (let i = 0; i < N; i++) {
          void g.mux.sendControl({
            type: "agent_event",
            turn: m.turn,
            event: { kind: "stdout", data: String(i) }
          })
        }
        void g.mux.sendControl({
          type: "turn_end",
          turn: m.turn,
          exitCode: 0,
          signal: null,
          cancelled: false
        })
      })
      const conn = yield* accept
      const events = yield* conn.turn("flood").pipe(
        Stream.tap((e) =>
          e._tag === "Event" && e.event.kind === "stdout" && e.event.data === "0"
            ? realDelay(200)
            : Effect.void
        ),
        Stream.runCollect
      )
      const all = Chunk.toReadonlyArray(events)
      expect(all).toHaveLength(N + 1)
      expect(
        all
          .slice(0, N)
          .map((e) => (e._tag === "Event" && e.event.kind === "stdout" ? Number(e.event.data) : -1))
      ).toEqual(Array.from({ length: N }, (_, i) => i))
      expect(all[N]).toMatchObject({ _tag: "End", exitCode: 0 })
    }).pipe(Effect.scoped, provide)
  )

  it.live("a turn fails with GuestDisconnected when the guest dies mid-turn", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* listen(path)
      const guestP = fakeGuest(path, async (g, m) => {
        if (m.type === "user_turn") {
          await g.mux.sendControl({
            type: "agent_event",
            turn: m.turn,
            event: { kind: "stderr", data: "boom" }
          })
          g.socket.destroy()
        }
      })
      const conn = yield* accept
      const exit = yield* Effect.exit(Stream.runCollect(conn.turn("x")))
      expect(Exit.isFailure(exit)).toBe(true)
      expect(JSON.stringify(exit)).toMatch(/GuestDisconnected/)
      yield* Effect.promise(() => guestP)
      const after = yield* Stream.runCollect(conn.turn("y")).pipe(Effect.flip)
      expect(after._tag).toBe("GuestDisconnected")
    }).pipe(Effect.scoped, provide)
  )

  it.live("tunnels: accept carries bytes both ways over an odd channel; deny answers tunnel_deny", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* listen(path)
      const fromHost: Array<string> = []
      let done!: () => void
      const finished = new Promise<void>((r) => (done = r))
      const guestP = fakeGuest(path, async (g, m) => {
        if (m.type === "tunnel_accept") {
          const ch = g.mux.channel(m.channel)
          await ch.write(Buffer.from("CONNECT-BYTES"))
          await ch.end()
          try {
            for await (const c of ch.readable) fromHost.push(Buffer.from(c).toString())
          } catch {
            // tunnel_close from the host ends the channel
          }
          done()
        }
      })
      const conn = yield* accept
      const guest = yield* Effect.promise(() => guestP)
      yield* Effect.promise(() =>
        guest.mux.sendControl({ type: "tunnel_open", channel: 1, host: "example.com", port: 443 })
      )
      yield* Effect.promise(() =>
        guest.mux.sendControl({ type: "tunnel_open", channel: 3, host: "evil.test", port: 22 })
      )
      const requests = Chunk.toReadonlyArray(yield* Stream.runCollect(conn.tunnels.pipe(Stream.take(2))))
      expect(requests.map((r) => [r.channel, r.host, r.port])).toEqual([
        [1, "example.com", 443],
        [3, "evil.test", 22]
      ])
      yield* requests[1]!.deny("not allowed")
      const handle = yield* requests[0]!.accept()
      const got = yield* Stream.runCollect(handle.read)
      expect(Buffer.concat(Chunk.toReadonlyArray(got)).toString()).toBe("CONNECT-BYTES")
      yield* handle.write(Buffer.from("reply"))
      yield* realDelay(30)
      yield* handle.close
      yield* Effect.promise(() => finished)
      expect(fromHost.join("")).toBe("reply")
      expect(guest.received.filter((m) => m.type.startsWith("tunnel"))).toEqual([
        { type: "tunnel_deny", channel: 3, reason: "not allowed" },
        { type: "tunnel_accept", channel: 1 },
        { type: "tunnel_close", channel: 1 }
      ])
    }).pipe(Effect.scoped, provide)
  )
})
