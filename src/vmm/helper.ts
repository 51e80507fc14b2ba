/**
 * abox-vmm: owns one VMM process for its supervisor (the QemuVmm layer).
 *
 *   stdin   one HelperSpec JSON line (src/vmm/protocol.ts)
 *   stdout  HelperEvent JSON lines: started {pid}, stopping {reason}, exited {code, signal}
 *   fd 3    liveness pipe: EOF = the supervisor died → bounded stop of the VMM, then exit
 *   fd 4    the session's locked fd, passed on to the VMM (the lock lives as long as the VM)
 *
 * SIGTERM (Linux) / SIGINT (macOS) → the same bounded stop: QMP quit (QEMU) or REST Stop, HardStop
 * (vfkit) → wait → the fallback signal (`spec.signal`, default SIGTERM) → wait →
 * SIGKILL; the VMM is always reaped before the helper exits.
 */
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Fiber from "effect/Fiber"
import * as ParseResult from "effect/ParseResult"
// Raw node:child_process / node:net / node:fs: the VMM must inherit fd 4 (the lock) and the
// helper must read fd 3 (liveness); @effect/platform's Command passes neither extra fds nor
// lets us watch an inherited descriptor.
import { spawn, type ChildProcess } from "node:child_process"
import * as fs from "node:fs"
import * as net from "node:net"
import { BoundedConsole } from "./console.js"
import { qmpCommand } from "./qmp.js"
import { vfkitSetState } from "./vfkit.js"
import {
  decodeHelperSpec,
  encodeHelperEvent,
  type HelperEvent,
  type HelperSpec,
  LIVENESS_FD,
  LOCK_FD
} from "./protocol.js"

// the supervisor may be gone: writes to its pipes must never crash the helper
process.stdout.on("error", () => undefined)
process.stderr.on("error", () => undefined)

const emit = (event: HelperEvent) =>
  Effect.sync(() => {
    process.stdout.write(encodeHelperEvent(event) + "\n")
  })

const readStdinLine = Effect.async<string, string>((resume) => {
  let text = ""
  process.stdin.setEncoding("utf8")
  const onData = (chunk: string) => {
    text += chunk
    const newline = text.indexOf("\n")
    if (newline !== -1) {
      process.stdin.off("data", onData)
      process.stdin.pause()
      resume(Effect.succeed(text.slice(0, newline)))
    }
  }
  process.stdin.on("data", onData)
  process.stdin.on("end", () =>
    resume(text.trim() === "" ? Effect.fail("no spec on stdin") : Effect.succeed(text))
  )
})

const fdOpen = (fd: number): boolean => {
  try {
    fs.fstatSync(fd)
    return true
  } catch {
    return false
  }
}

interface Exit {
  readonly code: number | null
  readonly signal: string | null
}

const stopSequence = (spec: HelperSpec, child: ChildProcess, exited: Deferred.Deferred<Exit>) =>
  Effect.gen(function* () {
    const waitFor = (ms: number) =>
      Deferred.await(exited).pipe(
        Effect.timeout(Duration.millis(ms)),
        Effect.option,
        Effect.map((o) => o._tag === "Some")
      )
    if (spec.qmpSocket !== undefined) {
      yield* qmpCommand(spec.qmpSocket, "quit", Duration.millis(spec.quitMs)).pipe(Effect.ignore)
      if (yield* waitFor(spec.quitMs)) return
    }
    if (spec.restSocket !== undefined) {
      // vfkit: Stop asks the guest (RequestStop); HardStop stops the VM without asking
      for (const state of ["Stop", "HardStop"] as const) {
        yield* vfkitSetState(spec.restSocket, state, Duration.millis(spec.quitMs)).pipe(Effect.ignore)
        if (yield* waitFor(spec.quitMs)) return
      }
    }
    child.kill(spec.signal ?? "SIGTERM")
    if (yield* waitFor(spec.termMs)) return
    child.kill("SIGKILL")
    yield* Deferred.await(exited)
  })

const main = Effect.gen(function* () {
  const line = yield* readStdinLine
  const decoded = decodeHelperSpec(line)
  if (Either.isLeft(decoded)) {
    yield* emit({
      event: "error",
      message: `bad spec: ${ParseResult.TreeFormatter.formatErrorSync(decoded.left)}`
    })
    return 64
  }
  const spec = decoded.right
  const console = new BoundedConsole(spec.consoleLog, spec.consoleMaxBytes)
  const exited = yield* Deferred.make<Exit>()
  const stop = yield* Deferred.make<string>()

  const child = spawn(spec.command, [...spec.args], {
    env: spec.env,
    // fd 3 is a fresh pipe so the VMM never holds our liveness fd; fd 4 is the lock
    stdio: ["ignore", "pipe", "pipe", "pipe", fdOpen(LOCK_FD) ? LOCK_FD : "ignore"]
  })
  const spawnError = yield* Deferred.make<string>()
  child.on("error", (error) => Deferred.unsafeDone(spawnError, Effect.succeed(error.message)))
  child.stdout?.on("data", (chunk: Buffer) => console.write(chunk))
  child.stderr?.on("data", (chunk: Buffer) => console.write(chunk))
  child.on("exit", (code, signal) => Deferred.unsafeDone(exited, Effect.succeed({ code, signal })))

  if (child.pid === undefined) {
    const message = yield* Deferred.await(spawnError)
    yield* emit({ event: "error", message: `cannot start ${spec.command}: ${message}` })
    console.close()
    return 69
  }
  yield* emit({ event: "started", pid: child.pid })

  // liveness: EOF (or error) on fd 3 means the supervisor is gone
  if (fdOpen(LIVENESS_FD)) {
    const liveness = new net.Socket({ fd: LIVENESS_FD, readable: true, writable: false })
    liveness.on("data", () => undefined)
    const gone = () => Deferred.unsafeDone(stop, Effect.succeed("supervisor gone"))
    liveness.on("end", gone)
    liveness.on("close", gone)
    liveness.on("error", gone)
  }
  const onSignal = (signal: NodeJS.Signals) => Deferred.unsafeDone(stop, Effect.succeed(signal))
  const fallback = spec.signal ?? (process.platform === "darwin" ? "SIGINT" : "SIGTERM")
  process.on("SIGTERM", onSignal)
  process.on("SIGINT", process.platform === "darwin" || fallback === "SIGINT" ? onSignal : () => undefined)
  process.on("SIGHUP", () => undefined)

  const stopper = yield* Deferred.await(stop).pipe(
    Effect.tap((reason) => emit({ event: "stopping", reason })),
    Effect.zipRight(stopSequence(spec, child, exited)),
    Effect.fork
  )
  const exit = yield* Deferred.await(exited)
  yield* Fiber.interrupt(stopper)
  // drain what the VMM wrote last
  yield* Effect.async<void>((resume) => {
    let open = 2
    const done = () => {
      open -= 1
      if (open === 0) resume(Effect.void)
    }
    if (child.stdout === null || child.stdout.readableEnded) done()
    else child.stdout.once("close", done)
    if (child.stderr === null || child.stderr.readableEnded) done()
    else child.stderr.once("close", done)
  }).pipe(Effect.timeout(Duration.seconds(1)), Effect.ignore)
  console.close()
  yield* emit({ event: "exited", code: exit.code, signal: exit.signal })
  return 0
})

// the entry point of its own process: the one place that runs an Effect
Effect.runPromise(main).then(
  (code) => process.exit(code),
  (error: unknown) => {
    process.stderr.write(`abox-vmm: ${String(error)}\n`)
    process.exit(70)
  }
)
