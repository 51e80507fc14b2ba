/**
 * The macOS VMM backend ("vz"): vfkit (Virtualization.framework) behind the abox-vmm helper,
 * arm64 guests. Same shape as QemuVmm: the supervisor spawns the helper with the liveness pipe
 * (fd 3) and the session's locked fd (fd 4); the helper runs vfkit and stops it on request.
 *
 * Close (the scope's finalizer; the GuestRpc shutdown ran before it): bounded wait for the guest
 * to power off → SIGINT to the helper (seed 000: on macOS the helper fallback signal is SIGINT)
 * → the helper asks vfkit over its REST socket (Stop, then HardStop), then signals vfkit
 * (SIGINT: vfkit's own handler requests a stop and forces it after 5 s) → bounded wait →
 * SIGKILL to the helper and vfkit → reap.
 *
 * The guest RPC channel: vfkit listens on the guest's vsock port 1024 and dials the host's
 * rpc.sock for each guest connection, where GuestRpc is already listening: the host side is the
 * same code as on Linux.
 */
import * as Deferred from "effect/Deferred"
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
// Raw node:child_process / node:fs: the helper needs an inherited liveness pipe (fd 3) and the
// session's locked fd (fd 4), which @effect/platform's Command cannot pass.
import { spawn, type ChildProcess } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import * as readline from "node:readline"
import { ensureSocketDir, maxSocketPathBytes, vfkitSocketPath } from "../lib/socketPath.js"
import { hostArch } from "../programs/compat.js"
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
import { minimalEnv } from "../vmm/argv.js"
import { consoleTail } from "../vmm/console.js"
import { decodeHelperEvent, encodeHelperSpec } from "../vmm/protocol.js"
import { buildVfkitArgv, uncompressedKernel } from "../vmm/vfkit.js"
import { defaultHelper } from "./QemuVmm.js"

export interface DarwinVmmOptions {
  /** the platform whose rules apply (fallback signal, socket path limit); default process.platform */
  readonly platform?: NodeJS.Platform
  /** the vfkit executable: a path, or a name looked up on PATH (default: $ABOX_VFKIT, else `vfkit`) */
  readonly vfkit?: string
  /** guest architecture (default: the host's, aarch64 on Apple silicon; Virtualization.framework does not emulate) */
  readonly arch?: GuestArch
  /** argv of the helper (default: `node <dist>/abox-vmm.js`) */
  readonly helper?: ReadonlyArray<string>
  /** how long each helper step (REST Stop, REST HardStop, signal) waits; default 1500 ms */
  readonly stepMs?: number
  /** bound of vfkit's own log (the helper's console file, `vfkit.log`); default 1 MiB */
  readonly vfkitLogMaxBytes?: number
}

/** seed 000: on macOS the helper fallback signal is SIGINT; on Linux SIGTERM, never SIGINT */
export const fallbackSignalFor = (platform: NodeJS.Platform): "SIGINT" | "SIGTERM" =>
  platform === "darwin" ? "SIGINT" : "SIGTERM"

const vmmError = (reason: string, message: string) => new VmmError({ backend: "vz", reason, message })

const findExecutable = (binary: string): string | undefined => {
  const candidates = binary.includes("/")
    ? [binary]
    : (process.env.PATH ?? "/usr/local/bin:/opt/homebrew/bin:/usr/bin:/bin")
        .split(":")
        .concat(["/opt/homebrew/bin", "/usr/local/bin"])
        .map((dir) => path.join(dir, binary))
  return candidates.find((candidate) => {
    try {
      fs.accessSync(candidate, fs.constants.X_OK)
      return fs.statSync(candidate).isFile()
    } catch {
      return false
    }
  })
}

export const makeDarwinVmm = (options: DarwinVmmOptions = {}) =>
  Effect.sync(() => {
    const platform = options.platform ?? process.platform
    const arch = options.arch ?? hostArch()
    const fallbackSignal = fallbackSignalFor(platform)
    const stepMs = options.stepMs ?? 1500

    const start = Effect.fn("DarwinVmm.start")(function* (spec: VmSpec) {
      const wanted = options.vfkit ?? process.env.ABOX_VFKIT ?? "vfkit"
      const vfkit = findExecutable(wanted)
      if (vfkit === undefined) {
        return yield* new VmmUnavailable({
          backend: "vz",
          message: `${wanted} is not installed (brew install vfkit, or nix develop; see docs/macos.md)`
        })
      }
      if (spec.arch !== arch) {
        return yield* vmmError("arch", `the vz backend runs ${arch} guests; this image is ${spec.arch}`)
      }
      const limit = maxSocketPathBytes(platform)
      if (Buffer.byteLength(spec.rpcSocket) > limit) {
        return yield* vmmError(
          "socket_path",
          `${spec.rpcSocket} is longer than ${limit} bytes, the unix socket limit on ${platform} (use rpcSocketPath)`
        )
      }
      const restSocket = vfkitSocketPath(spec.sessionDir, platform)
      // a long session path puts the socket under /tmp/abox-<uid>: 0700 and ours, or refused
      yield* ensureSocketDir(restSocket).pipe(
        Effect.mapError((error) => vmmError("socket_path", error.message))
      )
      yield* Effect.sync(() => fs.rmSync(restSocket, { force: true }))
      const kernel = yield* uncompressedKernel(spec.kernel, spec.sessionDir).pipe(
        Effect.mapError((error) => vmmError("kernel", error.message))
      )
      const built = buildVfkitArgv({ ...spec, kernel, restSocket })
      if (Either.isLeft(built)) return yield* vmmError("path", built.left.message)
      const args = built.right

      const helperArgv = options.helper ?? defaultHelper()
      const exited = yield* Deferred.make<VmExit>()
      const started = yield* Deferred.make<number, VmmError>()
      const outcomeRef = yield* Deferred.make<CloseOutcome>()
      const helperExit = yield* Deferred.make<{ code: number | null; signal: string | null }>()
      const stderrTail: Array<string> = []

      const closeSequence = (child: ChildProcess) =>
        Effect.gen(function* () {
          const waitExit = (bound: Duration.DurationInput) =>
            Deferred.await(exited).pipe(
              Effect.zipRight(Deferred.await(helperExit)),
              // finalizers run uninterruptibly, and a timeout cannot cut short an uninterruptible
              // wait: without this, the bound would wait for the exit it is meant to bound
              Effect.interruptible,
              Effect.timeout(bound),
              Effect.option,
              Effect.map((o) => Option.isSome(o))
            )
          const send = (pid: number | undefined, signal: NodeJS.Signals) =>
            Effect.sync(() => {
              if (pid === undefined) return
              try {
                process.kill(pid, signal)
              } catch {
                // already gone
              }
            })
          const alreadyDone = yield* Deferred.isDone(exited)
          let how: CloseOutcome["how"] = alreadyDone ? "crashed" : "graceful"
          if (!(yield* waitExit(spec.bounds.graceful))) {
            how = "signalled"
            yield* send(child.pid, fallbackSignal)
            if (!(yield* waitExit(spec.bounds.signalled))) {
              how = "killed"
              const vmmPid = yield* Deferred.poll(started).pipe(
                Effect.flatMap((o) => (Option.isSome(o) ? Effect.option(o.value) : Effect.succeedNone))
              )
              yield* send(child.pid, "SIGKILL")
              if (Option.isSome(vmmPid)) yield* send(vmmPid.value, "SIGKILL")
              yield* waitExit(spec.bounds.killed)
              // a SIGKILLed helper says nothing: its exit is the VM's end (vfkit was killed too)
              yield* Deferred.succeed(exited, { exitCode: null, signal: "SIGKILL" })
            }
          }
          const exit = yield* Deferred.await(exited)
          if (how === "crashed" && exit.exitCode === 0 && exit.signal === null) how = "graceful"
          const tail = how === "graceful" ? [] : consoleTail(spec.consoleLog, 20)
          yield* Deferred.succeed(outcomeRef, {
            at: new Date().toISOString(),
            how,
            exitCode: exit.exitCode,
            signal: exit.signal,
            ...(tail.length > 0 ? { consoleTail: tail } : {})
          })
          yield* Effect.sync(() => fs.rmSync(restSocket, { force: true }))
        })

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
        if (Either.isLeft(decoded)) return
        const event = decoded.right
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
              `abox-vmm exited (${code ?? signal}) before starting vfkit: ${stderrTail.join(" | ")}`
            )
          )
        )
        Deferred.unsafeDone(exited, Effect.succeed({ exitCode: code, signal }))
      })
      helper.stdin!.end(
        encodeHelperSpec({
          command: vfkit,
          args,
          env: minimalEnv(),
          // vfkit writes the guest serial into console.log itself (virtio-serial,logFilePath);
          // the helper keeps vfkit's own output, bounded, beside it
          consoleLog: path.join(spec.sessionDir, "vfkit.log"),
          consoleMaxBytes: options.vfkitLogMaxBytes ?? 1024 * 1024,
          restSocket,
          signal: fallbackSignal,
          quitMs: stepMs,
          termMs: stepMs
        }) + "\n"
      )

      const vmmPid = yield* Deferred.await(started)
      const handle: VmHandle = {
        backend: "vz",
        helperPid: helper.pid ?? -1,
        vmmPid,
        exited: Deferred.await(exited),
        outcome: Deferred.await(outcomeRef)
      }
      return handle
    })

    return VmmBackend.of({ name: "vz", arch, start } satisfies VmmBackendShape)
  })

/** The macOS VMM backend: vfkit (Virtualization.framework) behind the abox-vmm helper. */
export const DarwinVmmLive = (options: DarwinVmmOptions = {}) =>
  Layer.effect(VmmBackend, makeDarwinVmm(options))
