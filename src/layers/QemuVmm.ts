import * as Deferred from "effect/Deferred"
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Ref from "effect/Ref"
import * as Schedule from "effect/Schedule"
// Raw node:child_process / node:fs: the helper needs an inherited liveness pipe (fd 3) and the
// session's locked fd (fd 4), which @effect/platform's Command cannot pass; /dev/kvm is probed
// by opening it read-write.
import { execFile, spawn } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import * as readline from "node:readline"
import { fileURLToPath } from "node:url"
import type { CloseOutcome, GuestArch } from "../services/SessionStore.js"
import {
  type VmExit,
  type VmHandle,
  VmmBackend,
  type VmmBackendShape,
  VmmError,
  VmmUnavailable,
  type VmSpec
} from "../services/VmmBackend.js"
import { type Accel, buildQemuArgv, minimalEnv, qemuBinary } from "../vmm/argv.js"
import { ensureSocketDir, sessionSocketPath } from "../lib/socketPath.js"
import { consoleTail } from "../vmm/console.js"
import { decodeHelperEvent, encodeHelperSpec, type HelperEvent } from "../vmm/protocol.js"

export interface QemuVmmOptions {
  /** guest architecture this backend runs (default: the host's) */
  readonly arch?: GuestArch
  /** "auto" (default): KVM when /dev/kvm opens read-write and a probe VM starts on it, else TCG */
  readonly accel?: "auto" | Accel
  /** argv of the helper (default: `node <dist>/abox-vmm.js`) */
  readonly helper?: ReadonlyArray<string>
  /** console.log bound (default 8 MiB) */
  readonly consoleMaxBytes?: number
  /** where to say which accelerator was chosen (default: stderr, once) */
  readonly note?: (message: string) => void
}

const hostArch = (): GuestArch => (process.arch === "arm64" ? "aarch64" : "x86_64")

const which = (binary: string): string | undefined => {
  for (const dir of (process.env.PATH ?? "/usr/bin:/bin").split(":")) {
    const candidate = path.join(dir, binary)
    try {
      fs.accessSync(candidate, fs.constants.X_OK)
      return candidate
    } catch {
      // not here
    }
  }
  return undefined
}

/** the bundled helper next to this module (dist/) or, under tsx, the built one in <root>/dist */
export const defaultHelper = (): Array<string> => {
  const here = path.dirname(fileURLToPath(import.meta.url))
  const candidates = [path.join(here, "abox-vmm.js"), path.join(here, "..", "..", "dist", "abox-vmm.js")]
  const found = candidates.find((file) => fs.existsSync(file)) ?? candidates[0]!
  return [process.execPath, found]
}

/** a process that has exited (absent, or a zombie: its descriptors, the lock among them, are closed) */
const processGone = (pid: number): boolean => {
  try {
    const stat = fs.readFileSync(`/proc/${pid}/stat`, "utf8")
    return stat.slice(stat.lastIndexOf(")") + 2, stat.lastIndexOf(")") + 3) === "Z"
  } catch {
    // no /proc entry: gone (or no /proc at all, where the helper's own reaping is all there is)
    return true
  }
}

const kvmOpens = (): boolean => {
  try {
    fs.closeSync(fs.openSync("/dev/kvm", fs.constants.O_RDWR))
    return true
  } catch {
    return false
  }
}

/**
 * /dev/kvm opening is not enough (nested hosts may refuse the CPU model at reset): start a
 * paused VM with `-cpu host` and quit it over QMP on stdin; success = a clean exit.
 */
const probeKvm = (binary: string, arch: GuestArch) =>
  Effect.async<boolean>((resume) => {
    const machine = arch === "x86_64" ? "q35" : "virt"
    const child = execFile(
      binary,
      [
        "-nodefaults",
        "-no-user-config",
        "-machine",
        `${machine},accel=kvm`,
        "-cpu",
        "host",
        "-display",
        "none",
        "-S",
        "-qmp",
        "stdio"
      ],
      { env: minimalEnv(), timeout: 10_000 },
      (error, _stdout, stderr) => resume(Effect.succeed(error === null && !/error/i.test(stderr)))
    )
    child.stdin?.end('{"execute":"qmp_capabilities"}\n{"execute":"query-status"}\n{"execute":"quit"}\n')
  })

/** what `auto` chooses on this host: KVM when /dev/kvm opens and a probe VM starts on it (abox doctor) */
export const kvmUsable = (arch: GuestArch = hostArch()): Effect.Effect<boolean> =>
  kvmOpens() ? probeKvm(qemuBinary(arch), arch) : Effect.succeed(false)

const vmmError = (reason: string, message: string) => new VmmError({ backend: "qemu", reason, message })

export const makeQemuVmm = (options: QemuVmmOptions = {}) =>
  Effect.gen(function* () {
    const arch = options.arch ?? hostArch()
    const binary = qemuBinary(arch)
    const note = options.note ?? ((message: string) => process.stderr.write(`abox: ${message}\n`))
    const accelRef = yield* Ref.make(Option.none<Accel>())

    const chooseAccel = (qemu: string) =>
      Effect.gen(function* () {
        const known = yield* Ref.get(accelRef)
        if (Option.isSome(known)) return known.value
        let accel: Accel
        const wanted = options.accel ?? (process.env.ABOX_QEMU_ACCEL as "auto" | Accel | undefined) ?? "auto"
        if (wanted !== "auto") accel = wanted
        else if (!kvmOpens()) {
          accel = "tcg"
          note("qemu: /dev/kvm is not usable here; guests run under TCG (slower)")
        } else if (yield* probeKvm(qemu, arch)) accel = "kvm"
        else {
          accel = "tcg"
          note("qemu: /dev/kvm opens but a KVM VM does not start on this host; guests run under TCG (slower)")
        }
        yield* Ref.set(accelRef, Option.some(accel))
        return accel
      })

    const start = Effect.fn("QemuVmm.start")(function* (spec: VmSpec) {
      const qemu = which(binary)
      if (qemu === undefined) {
        return yield* new VmmUnavailable({
          backend: "qemu",
          message: `${binary} is not installed (apt-get install qemu-system-${arch === "x86_64" ? "x86" : "arm"})`
        })
      }
      const accel = yield* chooseAccel(qemu)
      // <dir>/qmp.sock, or a short path where that is too long for a unix socket
      const qmpSocket = sessionSocketPath(spec.sessionDir, "qmp.sock")
      yield* ensureSocketDir(qmpSocket).pipe(Effect.mapError((e) => vmmError("qmp", e.message)))
      yield* Effect.sync(() => fs.rmSync(qmpSocket, { force: true }))
      const args = buildQemuArgv({ ...spec, accel, qmpSocket })
      const helperArgv = options.helper ?? defaultHelper()
      const exited = yield* Deferred.make<VmExit>()
      const started = yield* Deferred.make<number, VmmError>()
      const outcomeRef = yield* Deferred.make<CloseOutcome>()
      const stderrTail: Array<string> = []

      // acquire: the helper process; release: the VMM half of Close (bounded, always reaped)
      const helper = yield* Effect.acquireRelease(
        Effect.try({
          try: () =>
            spawn(helperArgv[0]!, helperArgv.slice(1), {
              env: minimalEnv(),
              // own process group: a terminal's Ctrl-C reaches the CLI (which closes), not the helper
              detached: true,
              stdio: ["pipe", "pipe", "pipe", "pipe", spec.lockFd >= 0 ? spec.lockFd : "ignore"]
            }),
          catch: (cause) => vmmError("helper", `cannot start abox-vmm: ${String(cause)}`)
        }),
        (child) => closeSequence(child)
      )
      const helperExit = yield* Deferred.make<{ code: number | null; signal: string | null }>()
      helper.on("exit", (code, signal) => Deferred.unsafeDone(helperExit, Effect.succeed({ code, signal })))
      helper.on("error", (error) =>
        Deferred.unsafeDone(started, Effect.fail(vmmError("helper", `abox-vmm: ${error.message}`)))
      )
      helper.stderr?.setEncoding("utf8")
      helper.stderr?.on("data", (chunk: string) => {
        stderrTail.push(...chunk.split("\n").filter((l) => l !== ""))
        stderrTail.splice(0, Math.max(0, stderrTail.length - 20))
      })
      const lines = readline.createInterface({ input: helper.stdout! })
      lines.on("line", (line) => {
        const decoded = decodeHelperEvent(line)
        if (Either.isLeft(decoded)) return
        const event: HelperEvent = decoded.right
        if (event.event === "started") Deferred.unsafeDone(started, Effect.succeed(event.pid))
        else if (event.event === "exited")
          Deferred.unsafeDone(exited, Effect.succeed({ exitCode: event.code, signal: event.signal }))
        else if (event.event === "error")
          Deferred.unsafeDone(started, Effect.fail(vmmError("start", event.message)))
      })
      // a helper that dies without a word: the VM is gone with it (or was never started)
      helper.on("exit", (code, signal) => {
        Deferred.unsafeDone(
          started,
          Effect.fail(
            vmmError(
              "helper",
              `abox-vmm exited (${code ?? signal}) before starting qemu: ${stderrTail.join(" | ")}`
            )
          )
        )
        Deferred.unsafeDone(exited, Effect.succeed({ exitCode: code, signal }))
      })
      helper.stdin!.end(
        encodeHelperSpec({
          command: qemu,
          args,
          env: minimalEnv(),
          consoleLog: spec.consoleLog,
          consoleMaxBytes: options.consoleMaxBytes ?? 8 * 1024 * 1024,
          qmpSocket,
          quitMs: 2000,
          termMs: 1000
        }) + "\n"
      )

      function closeSequence(child: ReturnType<typeof spawn>) {
        return Effect.gen(function* () {
          const waitExit = (bound: Duration.DurationInput) =>
            Deferred.await(exited).pipe(
              Effect.zipRight(Deferred.await(helperExit)),
              // finalizers run uninterruptibly; the wait itself must be interruptible for the bound to cut it
              Effect.interruptible,
              Effect.timeout(bound),
              Effect.option,
              Effect.map((o) => Option.isSome(o))
            )
          const alreadyDone = yield* Deferred.isDone(exited)
          let how: CloseOutcome["how"] = alreadyDone ? "crashed" : "graceful"
          if (!(yield* waitExit(spec.bounds.graceful))) {
            how = "signalled"
            yield* Effect.sync(() => child.kill(process.platform === "darwin" ? "SIGINT" : "SIGTERM"))
            if (!(yield* waitExit(spec.bounds.signalled))) {
              how = "killed"
              const vmmPid = yield* Deferred.poll(started).pipe(
                Effect.flatMap((o) =>
                  Option.isSome(o) ? Effect.option(o.value) : Effect.succeed(Option.none<number>())
                )
              )
              yield* Effect.sync(() => {
                child.kill("SIGKILL")
                if (Option.isSome(vmmPid)) {
                  try {
                    process.kill(vmmPid.value, "SIGKILL")
                  } catch {
                    // already gone
                  }
                }
              })
              yield* waitExit(spec.bounds.killed)
              // QEMU is the helper's child, not ours: no exit event reaches us. Its death after
              // SIGKILL is asynchronous, and it holds the session's lock fd until then, so watch
              // /proc (bounded) until it has released everything: gone, or a zombie.
              if (Option.isSome(vmmPid)) {
                yield* Effect.sync(() => processGone(vmmPid.value)).pipe(
                  Effect.repeat({ until: (gone) => gone, schedule: Schedule.spaced("10 millis") }),
                  Effect.interruptible,
                  Effect.timeout(spec.bounds.killed),
                  Effect.ignore
                )
              }
              // a SIGKILLed helper says nothing: its exit is the VM's end (QEMU was killed too)
              yield* Deferred.succeed(exited, { exitCode: null, signal: "SIGKILL" })
            }
          }
          const exit = yield* Deferred.await(exited)
          if (how === "crashed" && exit.exitCode === 0 && exit.signal === null) how = "graceful"
          const outcome: CloseOutcome = {
            at: new Date().toISOString(),
            how,
            exitCode: exit.exitCode,
            signal: exit.signal,
            ...(how === "graceful" ? {} : { consoleTail: consoleTail(spec.consoleLog, 20) })
          }
          yield* Deferred.succeed(outcomeRef, outcome)
          yield* Effect.sync(() => fs.rmSync(qmpSocket, { force: true }))
        })
      }

      const vmmPid = yield* Deferred.await(started)
      const handle: VmHandle = {
        backend: "qemu",
        helperPid: helper.pid ?? -1,
        vmmPid,
        exited: Deferred.await(exited),
        outcome: Deferred.await(outcomeRef)
      }
      return handle
    })

    return VmmBackend.of({ name: "qemu", arch, start } satisfies VmmBackendShape)
  })

/** The Linux VMM backend: QEMU (KVM when usable, else TCG) behind the abox-vmm helper. */
export const QemuVmmLive = (options: QemuVmmOptions = {}) => Layer.effect(VmmBackend, makeQemuVmm(options))
