/**
 * FakeVmm: a VmmBackend ("fake") for tests. `start` runs the real guest agent on the host as a
 * child process, talking protocol v4 over the session's rpc.sock exactly as a VM would (the host
 * listens there first). Its state and repo live in `<sessionDir>/fake-guest/` — the part of
 * root.raw that matters — so a resumed fake session finds its history and files again.
 *
 * Which guest runs (explicit, in this order):
 *   1. `ABOX_FAKE_GUEST=source` → `node --import tsx src/guest/main.ts` (always the current source);
 *   2. `ABOX_FAKE_GUEST=bundle`, or unset with `dist/abox-guest.js` present → `node dist/abox-guest.js`
 *      (what images ship; `npm test` builds it first);
 *   3. otherwise the source through tsx.
 *
 * The scoped finalizer is the VMM half of Close (src/lib/closeSequence.ts) with `spec.bounds`:
 * wait for the agent to exit by itself (it does after the shutdown RPC) → SIGTERM → wait →
 * SIGKILL → reap; the CloseOutcome is recorded in `handle.outcome`. Raw node:child_process is used because the finalizer needs the
 * pid, specific signals and an inherited fd (the session lock), and the console log takes the
 * agent's stdout/stderr directly as an fd.
 */
import { spawn, type ChildProcess } from "node:child_process"
import * as nodeFs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import * as FileSystem from "@effect/platform/FileSystem"
import * as Clock from "effect/Clock"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import { hostArch } from "../lib/arch.js"
import { closeSequence } from "../lib/closeSequence.js"
import type { CloseOutcome } from "../domain/session.js"
import { VmmBackend, type VmmBackendShape } from "../services/VmmBackend.js"
import { VmmError, type VmExit, type VmHandle, type VmSpec } from "../domain/vm.js"

/** the uid:gid turn processes get when the tests run as root (exists on every host: nobody) */
export const FAKE_GUEST_USER = "65534:65534"
/** how many console lines a non-graceful CloseOutcome keeps */
const CONSOLE_TAIL_LINES = 20

const findProjectRoot = (): string => {
  let dir = path.dirname(fileURLToPath(import.meta.url))
  for (;;) {
    if (nodeFs.existsSync(path.join(dir, "package.json"))) return dir
    const parent = path.dirname(dir)
    if (parent === dir) return process.cwd()
    dir = parent
  }
}

/** argv (node first) of the guest agent FakeVmm runs; see the module comment for the order */
export const guestAgentCommand = (root: string = findProjectRoot()): ReadonlyArray<string> => {
  const bundle = path.join(root, "dist", "abox-guest.js")
  const choice = process.env.ABOX_FAKE_GUEST
  if (choice === "bundle" || (choice !== "source" && nodeFs.existsSync(bundle)))
    return [process.execPath, bundle]
  return [process.execPath, "--import", "tsx", path.join(root, "src", "guest", "main.ts")]
}

export interface FakeGuestPaths {
  readonly dir: string
  readonly state: string
  readonly repo: string
  /** the VmSpec's resources of the last start (JSON) */
  readonly vmSpec: string
}

export const fakeGuestPaths = (sessionDir: string): FakeGuestPaths => {
  const dir = path.join(sessionDir, "fake-guest")
  return {
    dir,
    state: path.join(dir, "state"),
    repo: path.join(dir, "repo"),
    vmSpec: path.join(dir, "vm-spec.json")
  }
}

export interface FakeVmmOptions {
  /**
   * Replaces the guest's argv (tests of the close bounds run a process that ignores signals).
   * Receives the argv FakeVmm would run.
   */
  readonly command?: (spec: VmSpec, argv: ReadonlyArray<string>) => ReadonlyArray<string>
  /** extra environment for the guest process */
  readonly env?: Readonly<Record<string, string>>
  /** the root disk format the fake attaches (qcow2: Open makes an overlay of the golden) */
  readonly rootDiskFormat?: VmmBackendShape["rootDiskFormat"]
}

const isRoot = (): boolean => typeof process.getuid === "function" && process.getuid() === 0

const vmmError = (reason: string, message: string) => new VmmError({ backend: "fake", reason, message })

export const make = (options: FakeVmmOptions = {}) =>
  Effect.gen(function* () {
    const fs = yield* FileSystem.FileSystem

    const consoleTail = (file: string) =>
      fs.readFileString(file).pipe(
        Effect.map((text) =>
          text
            .split("\n")
            .filter((line) => line !== "")
            .slice(-CONSOLE_TAIL_LINES)
        ),
        Effect.orElseSucceed(() => [] as Array<string>)
      )

    const start = Effect.fn("FakeVmm.start")(function* (spec: VmSpec) {
      const paths = fakeGuestPaths(spec.sessionDir)
      yield* fs
        .makeDirectory(paths.dir, { recursive: true, mode: 0o700 })
        .pipe(
          Effect.mapError((error) => vmmError("setup_failed", `cannot create ${paths.dir}: ${error.message}`))
        )
      // what a VM would be given, for tests of what reaches the VMM (the flags → VmSpec path)
      yield* fs
        .writeFileString(
          paths.vmSpec,
          JSON.stringify({
            arch: spec.arch,
            cpus: spec.cpus,
            memoryMiB: spec.memoryMiB,
            kernel: spec.kernel,
            initrd: spec.initrd,
            rootDisk: spec.rootDisk,
            rootDiskFormat: spec.rootDiskFormat ?? "raw"
          }) + "\n"
        )
        .pipe(
          Effect.mapError((error) =>
            vmmError("setup_failed", `cannot write ${paths.vmSpec}: ${error.message}`)
          )
        )

      // runtime files turn processes read (the broker CA bundle): outside the 0700 session dir so
      // that the unprivileged turn user can reach them, and gone with the fake VM
      const runDir = yield* Effect.acquireRelease(
        Effect.try({
          try: () => {
            const dir = nodeFs.mkdtempSync(path.join(os.tmpdir(), "abox-fake-run-"))
            nodeFs.chmodSync(dir, 0o755)
            return dir
          },
          catch: (cause) =>
            vmmError("setup_failed", `cannot create the fake guest's run dir: ${String(cause)}`)
        }),
        (dir) => Effect.sync(() => nodeFs.rmSync(dir, { recursive: true, force: true }))
      )

      const argv = [
        ...guestAgentCommand(),
        "--rpc",
        `unix:${spec.rpcSocket}`,
        "--config",
        spec.configDisk,
        "--state",
        paths.state,
        "--repo",
        paths.repo,
        "--run",
        runDir,
        "--on-shutdown",
        "exit",
        // the host's block devices are never the guest's: no repository disk in a fake guest
        "--repo-disks",
        "off",
        ...(isRoot() ? ["--user", FAKE_GUEST_USER] : [])
      ]
      const [command, ...args] = options.command === undefined ? argv : options.command(spec, argv)

      // the console log gets the agent's stdout and stderr as an fd (the child keeps its own copy)
      const consoleFd = yield* Effect.acquireRelease(
        Effect.try({
          try: () => nodeFs.openSync(spec.consoleLog, "a", 0o600),
          catch: (cause) => vmmError("setup_failed", `cannot open ${spec.consoleLog}: ${String(cause)}`)
        }),
        (fd) => Effect.sync(() => nodeFs.closeSync(fd))
      )

      const exited = yield* Deferred.make<VmExit>()
      const outcome = yield* Deferred.make<CloseOutcome>()

      const child = yield* Effect.acquireRelease(
        Effect.async<ChildProcess, VmmError>((resume) => {
          let proc: ChildProcess
          try {
            proc = spawn(command!, args, {
              cwd: findProjectRoot(),
              env: { ...process.env, ...options.env },
              // fd 3: the session lock, held by the "VM" as long as it runs (as the helper does)
              stdio: ["ignore", consoleFd, consoleFd, ...(spec.lockFd >= 0 ? [spec.lockFd] : [])]
            })
          } catch (cause) {
            resume(Effect.fail(vmmError("spawn_failed", `cannot start the fake guest: ${String(cause)}`)))
            return
          }
          proc.once("exit", (exitCode, signal) => {
            Deferred.unsafeDone(exited, Exit.succeed({ exitCode, signal }))
          })
          proc.once("spawn", () => resume(Effect.succeed(proc)))
          proc.once("error", (cause) => {
            if (proc.pid === undefined) {
              resume(Effect.fail(vmmError("spawn_failed", `cannot start the fake guest: ${cause.message}`)))
            }
          })
        }),
        (proc) => closeVm(proc)
      )

      // the VMM half of Close: src/lib/closeSequence.ts (the guest's shutdown RPC ran before it)
      const closeVm = (proc: ChildProcess) =>
        Effect.gen(function* () {
          const send = (signal: NodeJS.Signals) =>
            Effect.sync(() => {
              try {
                proc.kill(signal)
              } catch {
                // already gone
              }
            })
          const { how, exit } = yield* closeSequence({
            bounds: spec.bounds,
            poll: Deferred.poll(exited).pipe(
              Effect.flatMap((done) => (Option.isSome(done) ? Effect.asSome(done.value) : Effect.succeedNone))
            ),
            exited: Deferred.await(exited),
            shutdown: Effect.void,
            signal: send("SIGTERM"),
            kill: send("SIGKILL")
          })
          const tail = how === "graceful" ? [] : yield* consoleTail(spec.consoleLog)
          const at = yield* Clock.currentTimeMillis
          const closed: CloseOutcome = {
            at: new Date(at).toISOString(),
            how,
            exitCode: Option.isSome(exit) ? exit.value.exitCode : null,
            signal: Option.isSome(exit) ? exit.value.signal : null,
            ...(tail.length > 0 ? { consoleTail: tail } : {})
          }
          yield* Effect.logDebug(`fake guest ${proc.pid} closed: ${how}`)
          yield* Deferred.succeed(outcome, closed)
        })

      const handle: VmHandle = {
        backend: "fake",
        helperPid: child.pid!,
        vmmPid: child.pid!,
        exited: Deferred.await(exited),
        outcome: Deferred.await(outcome)
      }
      return handle
    })

    const shape: VmmBackendShape = {
      name: "fake",
      arch: hostArch(),
      start,
      ...(options.rootDiskFormat === undefined ? {} : { rootDiskFormat: options.rootDiskFormat })
    }
    return shape
  })

/** the fake backend; needs a FileSystem (NodeContext / NodeFileSystem in tests) */
export const layer: Layer.Layer<VmmBackend, never, FileSystem.FileSystem> = Layer.effect(VmmBackend, make())

export const layerWith = (options: FakeVmmOptions): Layer.Layer<VmmBackend, never, FileSystem.FileSystem> =>
  Layer.effect(VmmBackend, make(options))
