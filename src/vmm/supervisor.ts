/**
 * The supervisor side of the abox-vmm helper, shared by both VMM backends (QemuVmm on Linux,
 * DarwinVmm on macOS): spawn the helper with its HelperSpec on stdin, the liveness pipe (fd 3)
 * and the session's locked fd (fd 4), read its events (src/vmm/protocol.ts), and give back the
 * VmHandle once the VMM has started. Scoped: the finalizer is the VMM half of Close.
 *
 * Close (the GuestRpc shutdown ran before it) is src/lib/closeSequence.ts: bounded wait for the
 * VM to exit → the helper fallback signal (SIGTERM on Linux, SIGINT on macOS) → bounded wait →
 * SIGKILL to the helper and the VMM → bounded wait until the VMM is really gone; then the outcome
 * (graceful, signalled, killed or crashed, with the console tail unless graceful) → the
 * backend's cleanup.
 */
import * as Clock from "effect/Clock"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Schedule from "effect/Schedule"
// Raw node:child_process / node:fs: the helper needs an inherited liveness pipe (fd 3) and the
// session's locked fd (fd 4), which @effect/platform's Command cannot pass; /proc is read (or,
// without one, signal 0 sent) to see the VMM (not our child) go.
import { type ChildProcess, spawn } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import * as readline from "node:readline"
import { fileURLToPath } from "node:url"
import { closeSequence } from "../lib/closeSequence.js"
import type { CloseOutcome, VmmBackendName } from "../domain/session.js"
import { type VmExit, type VmHandle, VmmError, type VmSpec } from "../domain/vm.js"
import { minimalEnv } from "./argv.js"
import { consoleTail } from "./console.js"
import { decodeHelperEvent, encodeHelperSpec, type HelperSpec } from "./protocol.js"

/** seed 000: on macOS the helper fallback signal is SIGINT; on Linux SIGTERM, never SIGINT */
export const fallbackSignalFor = (platform: NodeJS.Platform): "SIGINT" | "SIGTERM" =>
  platform === "darwin" ? "SIGINT" : "SIGTERM"

/** the bundled helper next to this module (dist/) or, under tsx, the built one in <root>/dist */
export const defaultHelper = (): Array<string> => {
  const here = path.dirname(fileURLToPath(import.meta.url))
  const candidates = [path.join(here, "abox-vmm.js"), path.join(here, "..", "..", "dist", "abox-vmm.js")]
  const found = candidates.find((file) => fs.existsSync(file)) ?? candidates[0]!
  return [process.execPath, found]
}

/**
 * A process that has exited (absent, or a zombie: its descriptors, the lock among them, are
 * closed). Where there is no /proc (macOS), signal 0 tells: the pid answers until it is reaped,
 * so a resume right after a close never finds the lock still held by a VMM on its way out.
 */
export const processGone = (pid: number, procDir = "/proc"): boolean => {
  try {
    const stat = fs.readFileSync(path.join(procDir, String(pid), "stat"), "utf8")
    return stat.slice(stat.lastIndexOf(")") + 2, stat.lastIndexOf(")") + 3) === "Z"
  } catch {
    if (fs.existsSync(path.join(procDir, "self"))) return true
    try {
      process.kill(pid, 0)
      return false
    } catch (error) {
      // EPERM: there, and someone else's
      return (error as NodeJS.ErrnoException).code !== "EPERM"
    }
  }
}

const sendSignal = (pid: number, signal: NodeJS.Signals) =>
  Effect.sync(() => {
    try {
      process.kill(pid, signal)
    } catch {
      // already gone
    }
  })

export interface SupervisorOptions {
  /** the backend, as VmHandle.backend and VmmError.backend */
  readonly backend: VmmBackendName
  /** the VMM's name in messages ("qemu", "vfkit") */
  readonly vmmName: string
  /** argv of the helper (default: `node <dist>/abox-vmm.js`) */
  readonly helper?: ReadonlyArray<string> | undefined
  /** what the helper runs and how it stops it: one JSON line on its stdin */
  readonly helperSpec: HelperSpec
  /** the signal Close sends the helper after the graceful bound (fallbackSignalFor) */
  readonly fallbackSignal: "SIGINT" | "SIGTERM"
  /** the session's locked fd, the guest console (its tail goes in the outcome) and the Close bounds */
  readonly vm: Pick<VmSpec, "lockFd" | "consoleLog" | "bounds">
  /** the last step of Close, once the outcome is known (e.g. removing the QMP / REST socket file) */
  readonly cleanup: Effect.Effect<void>
}

/**
 * Starts the helper, scoped, and waits for its `started` event (the VMM's pid): the VmHandle.
 * Fails with a VmmError when the helper cannot start, reports an error, or exits first; the
 * finalizer (Close) runs all the same.
 */
export const superviseHelper = Effect.fn("VmmSupervisor.start")(function* (options: SupervisorOptions) {
  const { backend, vm } = options
  const vmmError = (reason: string, message: string) => new VmmError({ backend, reason, message })
  const helperArgv = options.helper ?? defaultHelper()
  const exited = yield* Deferred.make<VmExit>()
  const started = yield* Deferred.make<number, VmmError>()
  const outcomeRef = yield* Deferred.make<CloseOutcome>()
  const helperExit = yield* Deferred.make<{ code: number | null; signal: string | null }>()
  const stderrTail: Array<string> = []

  /** the VMM's pid, once the helper said it started */
  const startedPid = Deferred.poll(started).pipe(
    Effect.flatMap((o) => (Option.isSome(o) ? Effect.option(o.value) : Effect.succeedNone))
  )
  /**
   * The VM's end as Close sees it: its exit event, the helper's own exit, and the VMM's pid
   * gone from /proc. The VMM is the helper's child, not ours: after a SIGKILL of both, its
   * death is asynchronous and it holds the session's lock fd until then, so watch /proc until
   * it has released everything (gone, or a zombie). The close sequence bounds this wait.
   */
  const vmEnded = Deferred.await(exited).pipe(
    Effect.zipLeft(Deferred.await(helperExit)),
    Effect.zipLeft(
      startedPid.pipe(
        Effect.flatMap(
          Option.match({
            onNone: () => Effect.void,
            onSome: (pid) =>
              Effect.sync(() => processGone(pid)).pipe(
                Effect.repeat({ until: (gone) => gone, schedule: Schedule.spaced("10 millis") })
              )
          })
        )
      )
    )
  )

  // the VMM half of Close: src/lib/closeSequence.ts (the guest's shutdown RPC ran before it)
  const closeVm = (child: ChildProcess) =>
    Effect.gen(function* () {
      const { how } = yield* closeSequence({
        bounds: vm.bounds,
        poll: Effect.gen(function* () {
          const helperGone = yield* Deferred.isDone(helperExit)
          const exit = yield* Deferred.poll(exited)
          if (!helperGone || Option.isNone(exit)) return Option.none()
          const pid = yield* startedPid
          if (Option.isSome(pid) && !processGone(pid.value)) return Option.none()
          return Option.some(yield* exit.value)
        }),
        exited: vmEnded,
        shutdown: Effect.void,
        signal: Effect.sync(() => child.kill(options.fallbackSignal)),
        kill: Effect.gen(function* () {
          yield* Effect.sync(() => child.kill("SIGKILL"))
          const pid = yield* startedPid
          if (Option.isSome(pid)) yield* sendSignal(pid.value, "SIGKILL")
        })
      })
      // a SIGKILLed helper says nothing: its exit is the VM's end (the VMM was killed too)
      if (how === "killed") yield* Deferred.succeed(exited, { exitCode: null, signal: "SIGKILL" })
      const exit = yield* Deferred.await(exited)
      const tail = how === "graceful" ? [] : consoleTail(vm.consoleLog, 20)
      const at = yield* Clock.currentTimeMillis
      yield* Deferred.succeed(outcomeRef, {
        at: new Date(at).toISOString(),
        how,
        exitCode: exit.exitCode,
        signal: exit.signal,
        ...(tail.length > 0 ? { consoleTail: tail } : {})
      })
      yield* options.cleanup
    })

  // acquire: the helper process; release: the VMM half of Close (bounded, always reaped)
  const helper = yield* Effect.acquireRelease(
    Effect.try({
      try: () =>
        spawn(helperArgv[0]!, helperArgv.slice(1), {
          env: minimalEnv(),
          // own process group: a terminal's Ctrl-C reaches the CLI (which closes), not the helper
          detached: true,
          stdio: ["pipe", "pipe", "pipe", "pipe", vm.lockFd >= 0 ? vm.lockFd : "ignore"]
        }),
      catch: (cause) => vmmError("helper", `cannot start abox-vmm: ${String(cause)}`)
    }),
    (child) => closeVm(child)
  )
  helper.on("error", (error) =>
    Deferred.unsafeDone(started, Effect.fail(vmmError("helper", `abox-vmm: ${error.message}`)))
  )
  helper.stderr?.setEncoding("utf8")
  helper.stderr?.on("data", (chunk: string) => {
    stderrTail.push(...chunk.split("\n").filter((line) => line !== ""))
    stderrTail.splice(0, Math.max(0, stderrTail.length - 20))
  })
  readline.createInterface({ input: helper.stdout! }).on("line", (line) => {
    const decoded = decodeHelperEvent(line)
    if (!decoded.ok) return
    const event = decoded.value
    if (event.event === "started") Deferred.unsafeDone(started, Effect.succeed(event.pid))
    else if (event.event === "exited")
      Deferred.unsafeDone(exited, Effect.succeed({ exitCode: event.code, signal: event.signal }))
    else if (event.event === "error")
      Deferred.unsafeDone(started, Effect.fail(vmmError("start", event.message)))
  })
  helper.on("exit", (code, signal) => {
    Deferred.unsafeDone(helperExit, Effect.succeed({ code, signal }))
    // a helper that dies without a word: the VM is gone with it (or was never started)
    Deferred.unsafeDone(
      started,
      Effect.fail(
        vmmError(
          "helper",
          `abox-vmm exited (${code ?? signal}) before starting ${options.vmmName}: ${stderrTail.join(" | ")}`
        )
      )
    )
    Deferred.unsafeDone(exited, Effect.succeed({ exitCode: code, signal }))
  })
  helper.stdin!.end(encodeHelperSpec(options.helperSpec) + "\n")

  const vmmPid = yield* Deferred.await(started)
  const handle: VmHandle = {
    backend,
    helperPid: helper.pid ?? -1,
    vmmPid,
    exited: Deferred.await(exited),
    outcome: Deferred.await(outcomeRef),
    ...(options.helperSpec.consoleLog !== vm.consoleLog ? { vmmLog: options.helperSpec.consoleLog } : {})
  }
  return handle
})
