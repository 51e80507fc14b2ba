/**
 * FakeVmm: its close bounds under the TestClock (with stand-in processes that exit, die on
 * SIGTERM, or ignore it), and the full path with GuestRpcLive and the real guest agent:
 * listen → start → hello/ready → transfer → 3 turns → shutdown → graceful exit → resume.
 */
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Layer from "effect/Layer"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as TestClock from "effect/TestClock"
import { create as createTar } from "tar"
import * as FakeVmm from "../src/layers/FakeVmm.js"
import { hostArch } from "../src/lib/arch.js"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { encodeConfigDisk } from "../src/protocol/ConfigDisk.js"
import { GuestRpc, type TurnEvent } from "../src/services/GuestRpc.js"
import { TransferFailed } from "../src/domain/transfer.js"
import { VmmBackend } from "../src/services/VmmBackend.js"
import { type VmSpec } from "../src/domain/vm.js"

const isRoot = typeof process.getuid === "function" && process.getuid() === 0

const makeSpec = (sessionDir: string): VmSpec => ({
  sessionId: path.basename(sessionDir),
  sessionDir,
  arch: hostArch(),
  kernel: "unused",
  initrd: "unused",
  rootDisk: path.join(sessionDir, "root.raw"),
  configDisk: path.join(sessionDir, "config.raw"),
  rpcSocket: path.join(sessionDir, "rpc.sock"),
  consoleLog: path.join(sessionDir, "console.log"),
  cpus: 1,
  memoryMiB: 256,
  lockFd: -1,
  bounds: { graceful: "10 seconds", signalled: "5 seconds", killed: "5 seconds" }
})

const newSession = (config: Parameters<typeof encodeConfigDisk>[0] | Buffer) => {
  const sessionDir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-fakevmm-"))
  fs.writeFileSync(
    path.join(sessionDir, "config.raw"),
    Buffer.isBuffer(config) ? config : encodeConfigDisk(config)
  )
  return makeSpec(sessionDir)
}

/** real time, not the TestClock: a stand-in process says it is ready on the console log */
const consoleSays = (file: string, text: string) =>
  Effect.promise(async () => {
    const deadline = Date.now() + 10_000
    while (Date.now() < deadline) {
      if (fs.existsSync(file) && fs.readFileSync(file, "utf8").includes(text)) return
      await new Promise((resolve) => setTimeout(resolve, 20))
    }
    throw new Error(`${file} never said ${text}`)
  })

/** the closing fiber is waiting on the TestClock (a bound) */
const closeIsWaiting = Effect.gen(function* () {
  while ((yield* TestClock.sleeps()).length === 0)
    yield* Effect.promise(() => new Promise((r) => setTimeout(r, 5)))
})

const standIn = (script: string) =>
  FakeVmm.layerWith({ command: () => ["/bin/sh", "-c", script] }).pipe(Layer.provide(NodeFileSystem.layer))

/** start a stand-in, close its scope on the TestClock, advancing `steps` bounds */
const closeWith = (script: string, steps: ReadonlyArray<Duration.DurationInput>) =>
  Effect.gen(function* () {
    const vmm = yield* VmmBackend
    const spec = newSession({ format: 1, sessionId: "s", model: "m" })
    const scope = yield* Scope.make()
    const handle = yield* vmm.start(spec).pipe(Scope.extend(scope))
    expect(handle.backend).toBe("fake")
    yield* consoleSays(spec.consoleLog, "ready")
    const closing = yield* Effect.fork(Scope.close(scope, Exit.void))
    for (const step of steps) {
      yield* closeIsWaiting
      yield* TestClock.adjust(step)
    }
    yield* Fiber.join(closing)
    return yield* handle.outcome
  }).pipe(Effect.provide(standIn(script)))

describe("FakeVmm close bounds (TestClock)", () => {
  it.effect("graceful: the process exits by itself within the first bound", () =>
    Effect.gen(function* () {
      const outcome = yield* closeWith("echo ready; sleep 0.3; exit 0", [])
      expect(outcome).toMatchObject({ how: "graceful", exitCode: 0, signal: null })
    })
  )

  it.effect("signalled: no exit within the graceful bound → SIGTERM ends it", () =>
    Effect.gen(function* () {
      const outcome = yield* closeWith("echo ready; exec sleep 60", ["10 seconds"])
      expect(outcome).toMatchObject({ how: "signalled", signal: "SIGTERM" })
      expect(outcome.consoleTail).toEqual(["ready"])
    })
  )

  it.effect("killed: SIGTERM ignored → SIGKILL after the second bound, then reaped", () =>
    Effect.gen(function* () {
      const outcome = yield* closeWith("trap '' TERM; echo ready; while :; do sleep 1; done", [
        "10 seconds",
        "5 seconds"
      ])
      expect(outcome).toMatchObject({ how: "killed", signal: "SIGKILL", exitCode: null })
    })
  )

  it.effect("crashed: the process was already gone with a failure status before close", () =>
    Effect.gen(function* () {
      const vmm = yield* VmmBackend
      const spec = newSession({ format: 1, sessionId: "s", model: "m" })
      const outcome = yield* Effect.scoped(
        Effect.gen(function* () {
          const handle = yield* vmm.start(spec)
          expect(yield* handle.exited).toEqual({ exitCode: 7, signal: null })
          return handle
        })
      ).pipe(Effect.flatMap((handle) => handle.outcome))
      expect(outcome).toMatchObject({ how: "crashed", exitCode: 7, consoleTail: ["ready"] })
    }).pipe(Effect.provide(standIn("echo ready; exit 7")))
  )
})

const rpcOptions = { helloTimeout: "20 seconds", shutdownTimeout: "10 seconds" } as const
const Live = Layer.mergeAll(GuestRpcLive, FakeVmm.layer.pipe(Layer.provide(NodeFileSystem.layer)))

const tarStream = (cwd: string, entries: ReadonlyArray<string>) =>
  Stream.fromAsyncIterable(
    createTar({ cwd, portable: true }, [...entries]) as AsyncIterable<Uint8Array>,
    (cause) => new TransferFailed({ reason: "snapshot", message: String(cause) })
  )

const stdoutOf = (events: Chunk.Chunk<{ readonly at: number; readonly event: TurnEvent }>) =>
  Chunk.toReadonlyArray(events)
    .map(({ event }) => (event._tag === "Event" && event.event.kind === "stdout" ? event.event.data : ""))
    .join("")

const timedTurn = (turn: Stream.Stream<TurnEvent, unknown>) =>
  Stream.runCollect(Stream.mapEffect(turn, (event) => Effect.sync(() => ({ at: Date.now(), event }))))

describe("FakeVmm + GuestRpcLive + the real guest agent", () => {
  it.live(
    "open → transfer → streaming, failing and cancelled turns → shutdown → graceful; resume keeps context and files",
    () =>
      Effect.gen(function* () {
        const rpc = yield* GuestRpc
        const vmm = yield* VmmBackend
        const spec = newSession({ format: 1, sessionId: "full", model: "m" })
        const src = path.join(spec.sessionDir, "src")
        fs.mkdirSync(path.join(src, "bin"), { recursive: true })
        fs.writeFileSync(path.join(src, "README.md"), "hello from the host\n")
        fs.writeFileSync(path.join(src, "bin", "tool"), "#!/bin/sh\necho tool ran\n", { mode: 0o755 })
        fs.symlinkSync("bin/tool", path.join(src, "tool-link"))

        const first = yield* Effect.scoped(
          Effect.gen(function* () {
            const listener = yield* rpc.listen(spec.rpcSocket, rpcOptions)
            const handle = yield* vmm.start(spec)
            const conn = yield* listener.accept
            expect(conn.hello).toMatchObject({ protocol: 4, contextTurns: 0 })

            const transferred = yield* conn.transfer(
              tarStream(src, ["README.md", "bin", "tool-link"]),
              "/work/repo"
            )
            expect(transferred.files).toBe(3)

            // 1: output over ~2 s arrives as it comes
            const streaming = yield* timedTurn(conn.turn("for i in 1 2 3; do echo tick $i; sleep 1; done"))
            const items = Chunk.toReadonlyArray(streaming)
            const end = items[items.length - 1]!
            expect(end.event).toEqual({ _tag: "End", exitCode: 0, signal: null, cancelled: false })
            expect(stdoutOf(streaming)).toBe("tick 1\ntick 2\ntick 3\n")
            expect(end.at - items[0]!.at).toBeGreaterThan(1500)

            // 2: fails with exit 3
            const failing = yield* timedTurn(conn.turn("./tool-link; exit 3"))
            expect(stdoutOf(failing)).toBe("tool ran\n")
            expect(Chunk.unsafeLast(failing).event).toMatchObject({
              _tag: "End",
              exitCode: 3,
              cancelled: false
            })

            // 3: interrupted by the host once it has started: the stream's finalizer cancels it
            const started = yield* conn.turn("echo started; sleep 60").pipe(
              Stream.takeUntil((event) => event._tag === "Event" && event.event.kind === "stdout"),
              Stream.runCollect
            )
            expect(stdoutOf(Chunk.map(started, (event) => ({ at: 0, event })))).toBe("started\n")
            return handle
          })
        )
        const outcome = yield* first.outcome
        expect(outcome).toMatchObject({ how: "graceful", exitCode: 0 })

        const paths = FakeVmm.fakeGuestPaths(spec.sessionDir)
        expect(fs.readlinkSync(path.join(paths.repo, "tool-link"))).toBe("bin/tool")
        expect(fs.statSync(path.join(paths.repo, "bin", "tool")).mode & 0o777).toBe(0o755)
        if (isRoot) expect(fs.statSync(path.join(paths.repo, "README.md")).uid).toBe(65534)
        const context = fs.readFileSync(path.join(paths.state, "context.json"), "utf8")
        expect(context).toContain('"cancelled": true')

        // resume: the same session dir, a new "boot"
        const second = yield* Effect.scoped(
          Effect.gen(function* () {
            const listener = yield* rpc.listen(spec.rpcSocket, rpcOptions)
            const handle = yield* vmm.start(spec)
            const conn = yield* listener.accept
            expect(conn.hello.contextTurns).toBe(3)
            const shown = yield* timedTurn(conn.turn("cat README.md"))
            expect(stdoutOf(shown)).toBe("hello from the host\n")
            return handle
          })
        )
        expect(yield* second.outcome).toMatchObject({ how: "graceful" })
      }).pipe(Effect.provide(Live)),
    60_000
  )

  // Needs GuestRpcLive's shutdown wait to be interruptible: it runs inside a finalizer
  // (uninterruptible), so `timeoutFail` cannot cut `Deferred.await(closed)` and Close hangs on a
  // guest that ignores shutdown. With `Effect.interruptible` before `timeoutFail` this passes.
  it.live(
    "a guest that ignores shutdown: the RPC bound, then the VMM bounds end it (signalled)",
    () =>
      Effect.gen(function* () {
        const rpc = yield* GuestRpc
        const vmm = yield* VmmBackend
        const spec = {
          ...newSession({ format: 1, sessionId: "stubborn", model: "m", ignoreShutdown: true }),
          bounds: { graceful: "500 millis", signalled: "5 seconds", killed: "5 seconds" }
        } satisfies VmSpec
        const startedAt = Date.now()
        const handle = yield* Effect.scoped(
          Effect.gen(function* () {
            const listener = yield* rpc.listen(spec.rpcSocket, {
              helloTimeout: "20 seconds",
              shutdownTimeout: "1 second"
            })
            const handle = yield* vmm.start(spec)
            yield* listener.accept
            return handle
          })
        )
        const outcome = yield* handle.outcome
        expect(outcome).toMatchObject({ how: "signalled" })
        expect(outcome.consoleTail?.join("\n")).toContain("shutdown ignored")
        expect(Date.now() - startedAt).toBeLessThan(15_000)
      }).pipe(Effect.provide(Live)),
    30_000
  )

  it.live("a corrupt config disk: the host gets a typed error at once, not a hang", () =>
    Effect.gen(function* () {
      const rpc = yield* GuestRpc
      const vmm = yield* VmmBackend
      const spec = newSession(Buffer.alloc(4096, 0x41))
      const startedAt = Date.now()
      const error = yield* Effect.scoped(
        Effect.gen(function* () {
          const listener = yield* rpc.listen(spec.rpcSocket, rpcOptions)
          const handle = yield* vmm.start(spec)
          const failed = yield* Effect.flip(listener.accept)
          expect((yield* handle.exited).exitCode).toBe(2)
          return failed
        })
      )
      expect(["ProtocolError", "GuestDisconnected"]).toContain(error._tag)
      expect(Date.now() - startedAt).toBeLessThan(10_000)
      expect(fs.readFileSync(spec.consoleLog, "utf8")).toContain("bad magic")
    }).pipe(Effect.provide(Live))
  )
})
