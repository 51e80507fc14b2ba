import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import * as Ref from "effect/Ref"
// Raw node:fs: the accelerator record is a small file read and written in place.
import * as fs from "node:fs"
import * as path from "node:path"
import type { GuestArch } from "../domain/session.js"
import { VmmBackend, type VmmBackendShape } from "../services/VmmBackend.js"
import { VmmError, VmmUnavailable, type VmSpec } from "../domain/vm.js"
import { type Accel, buildQemuArgv, minimalEnv, qemuBinary } from "../vmm/argv.js"
import { kvmOpens, probeKvm } from "../vmm/kvm.js"
import { hostArch } from "../lib/arch.js"
import { ensureSocketDir, rpcSocketPath, sessionSocketPath } from "../lib/socketPath.js"
import { fallbackSignalFor, superviseHelper } from "../vmm/supervisor.js"
import { SESSION_FILES } from "../domain/sessionLayout.js"
import { findExecutable } from "../lib/executable.js"
import { execFileSync } from "node:child_process"
import type * as net from "node:net"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import { listenUnixServer } from "../lib/unixServer.js"
import { WARM_READY } from "../protocol/Messages.js"
import type { WarmBuildSpec } from "../domain/warm.js"
import { saveState } from "../vmm/warmSnapshot.js"
import { errorMessage } from "../domain/errorMessage.js"

export interface QemuVmmOptions {
  /** guest architecture this backend runs (default: the host's) */
  readonly arch?: GuestArch
  /** "auto" (default; the CLI and SDK pass $ABOX_QEMU_ACCEL): KVM when /dev/kvm opens read-write and a probe VM starts on it, else TCG */
  readonly accel?: "auto" | Accel
  /** argv of the helper (default: `node <dist>/abox-vmm.js`) */
  readonly helper?: ReadonlyArray<string>
  /** console.log bound (default 8 MiB) */
  readonly consoleMaxBytes?: number
  /** where to say which accelerator was chosen (default: stderr, once) */
  readonly note?: (message: string) => void
  /**
   * where the automatic choice is remembered (e.g. `$ABOX_HOME/cache/accel.json`): it holds
   * until the host reboots or QEMU changes, so the probe and its note happen once, not at every run
   */
  readonly accelCache?: string
}

/** what makes a remembered accelerator choice still true: this boot of the host, this QEMU binary */
const accelCacheKey = (qemu: string, arch: GuestArch): string => {
  const read = (file: string) => {
    try {
      return fs.readFileSync(file, "utf8").trim()
    } catch {
      return "-"
    }
  }
  const qemuStat = (() => {
    try {
      const stat = fs.statSync(qemu)
      return `${stat.ino}:${stat.size}:${stat.mtimeMs}`
    } catch {
      return "-"
    }
  })()
  return `${read("/proc/sys/kernel/random/boot_id")}|${qemu}|${qemuStat}|${arch}`
}

const AccelCache = Schema.Struct({ key: Schema.String, accel: Schema.Literal("kvm", "tcg", "hvf") })
const decodeAccelCache = Schema.decodeUnknownOption(Schema.parseJson(AccelCache))
const encodeAccelCache = Schema.encodeSync(Schema.parseJson(AccelCache))

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
        const wanted = options.accel ?? "auto"
        const cacheKey = accelCacheKey(qemu, arch)
        const remembered =
          options.accelCache === undefined
            ? Option.none<typeof AccelCache.Type>()
            : Option.filter(
                decodeAccelCache(
                  fs.existsSync(options.accelCache) ? fs.readFileSync(options.accelCache, "utf8") : ""
                ),
                (cached) => cached.key === cacheKey
              )
        if (wanted !== "auto") accel = wanted
        else if (Option.isSome(remembered)) accel = remembered.value.accel
        else if (!kvmOpens()) {
          accel = "tcg"
          note("qemu: /dev/kvm is not usable here; guests run under TCG (slower)")
        } else if (yield* probeKvm(qemu, arch)) accel = "kvm"
        else {
          accel = "tcg"
          note("qemu: /dev/kvm opens but a KVM VM does not start on this host; guests run under TCG (slower)")
        }
        if (wanted === "auto" && Option.isNone(remembered) && options.accelCache !== undefined) {
          const file = options.accelCache
          // best effort: without the record the probe simply runs again next time
          yield* Effect.sync(() => {
            fs.mkdirSync(path.dirname(file), { recursive: true, mode: 0o700 })
            fs.writeFileSync(file, encodeAccelCache({ key: cacheKey, accel }), { mode: 0o600 })
          }).pipe(Effect.catchAllDefect(() => Effect.void))
        }
        yield* Ref.set(accelRef, Option.some(accel))
        return accel
      })

    const start = Effect.fn("QemuVmm.start")(function* (spec: VmSpec) {
      const qemu = findExecutable(binary)
      if (qemu === undefined) {
        return yield* new VmmUnavailable({
          backend: "qemu",
          message: `${binary} is not installed (apt-get install qemu-system-${arch === "x86_64" ? "x86" : "arm"})`
        })
      }
      const accel = yield* chooseAccel(qemu)
      // <dir>/qmp.sock, or a short path where that is too long for a unix socket
      const qmpSocket = sessionSocketPath(spec.sessionDir, SESSION_FILES.qmpSocket)
      yield* ensureSocketDir(qmpSocket).pipe(Effect.mapError((e) => vmmError("qmp", e.message)))
      yield* Effect.sync(() => fs.rmSync(qmpSocket, { force: true }))
      const args = buildQemuArgv({ ...spec, accel, qmpSocket })
      return yield* superviseHelper({
        backend: "qemu",
        vmmName: "qemu",
        helper: options.helper,
        helperSpec: {
          command: qemu,
          args,
          env: minimalEnv(),
          consoleLog: spec.consoleLog,
          consoleMaxBytes: options.consoleMaxBytes ?? 8 * 1024 * 1024,
          qmpSocket,
          quitMs: 2000,
          termMs: 1000
        },
        fallbackSignal: fallbackSignalFor(process.platform),
        vm: spec,
        cleanup: Effect.sync(() => fs.rmSync(qmpSocket, { force: true }))
      })
    })

    const qemuPath = Effect.suspend(() => {
      const qemu = findExecutable(binary)
      return qemu === undefined
        ? Effect.fail(new VmmUnavailable({ backend: "qemu", message: `${binary} is not installed` }))
        : Effect.succeed(qemu)
    })

    /** `qemu-system-* --version`'s first line: a state file is restored only by the QEMU that saved it */
    const qemuVersion = (qemu: string) =>
      Effect.try({
        try: () =>
          execFileSync(qemu, ["--version"], { encoding: "utf8", env: minimalEnv() }).split("\n")[0]!.trim(),
        catch: (cause) => vmmError("version", `${qemu} --version: ${errorMessage(cause)}`)
      })

    const warmInputs = Effect.fn("QemuVmm.warm.inputs")(function* (
      image: { readonly digest: string },
      resources: { readonly cpus: number; readonly memoryMiB: number }
    ) {
      const qemu = yield* qemuPath
      const accel = yield* chooseAccel(qemu)
      const layout = buildQemuArgv({
        arch,
        accel,
        kernel: "<kernel>",
        initrd: "<initrd>",
        rootDisk: "<root>",
        rootDiskFormat: "qcow2",
        configDisk: "<config>",
        rpcSocket: "<rpc>",
        qmpSocket: "<qmp>",
        cpus: resources.cpus,
        memoryMiB: resources.memoryMiB,
        warm: {}
      })
      return {
        imageDigest: image.digest,
        qemuVersion: yield* qemuVersion(qemu),
        layout,
        cpus: resources.cpus,
        memoryMiB: resources.memoryMiB
      }
    })

    /**
     * The snapshot's boot: a raw listener on the rpc socket (QEMU connects at start), the golden
     * in the warm layout, WARM_READY from the waiting agent, then the state saved and the VM quit
     * (its scope: the helper's QMP quit of a paused VM). No session exists: no lock, no config.
     */
    const warmBuild = Effect.fn("QemuVmm.warm.build")(function* (spec: WarmBuildSpec) {
      // <workDir>/rpc.sock, or a short path where that is too long for a unix socket
      const rpcSocket = rpcSocketPath(spec.workDir)
      yield* ensureSocketDir(rpcSocket).pipe(Effect.mapError((e) => vmmError("warm", e.message)))
      const ready = yield* Deferred.make<void>()
      const held: Array<net.Socket> = []
      yield* Effect.acquireRelease(
        listenUnixServer(rpcSocket, {}, (socket) => {
          held.push(socket)
          let seen = ""
          socket.on("error", () => undefined)
          socket.on("data", (chunk: Buffer) => {
            seen = (seen + chunk.toString("latin1")).slice(-64)
            if (seen.includes(WARM_READY)) Deferred.unsafeDone(ready, Effect.void)
          })
        }).pipe(Effect.mapError((e) => vmmError("warm", e.message))),
        // the connection stays open until QEMU has quit: the saved guest never sees its host go
        (server) =>
          Effect.sync(() => {
            for (const socket of held) socket.destroy()
            server.close()
            fs.rmSync(rpcSocket, { force: true })
          })
      )
      const vm = yield* start({
        sessionId: "warm",
        sessionDir: spec.workDir,
        arch,
        kernel: spec.kernel,
        initrd: spec.initrd,
        rootDisk: spec.rootDisk,
        rootDiskFormat: "qcow2",
        configDisk: "",
        rpcSocket,
        consoleLog: path.join(spec.workDir, SESSION_FILES.consoleLog),
        cpus: spec.cpus,
        memoryMiB: spec.memoryMiB,
        lockFd: -1,
        bounds: { graceful: Duration.zero, signalled: "5 seconds", killed: "5 seconds" },
        warm: {}
      })
      yield* Effect.raceFirst(
        Deferred.await(ready),
        vm.exited.pipe(
          Effect.flatMap((exit) =>
            Effect.fail(
              vmmError("warm", `the VM exited before its guest waited (exit ${exit.exitCode ?? exit.signal})`)
            )
          )
        )
      ).pipe(
        Effect.timeoutFail({
          duration: "3 minutes",
          onTimeout: () => vmmError("warm", "the guest did not reach its waiting state within 3 minutes")
        })
      )
      const qmpSocket = sessionSocketPath(spec.workDir, SESSION_FILES.qmpSocket)
      yield* Effect.tryPromise({
        try: () => saveState(qmpSocket, spec.stateFile),
        catch: (cause) => vmmError("warm", `saving the VM's state: ${errorMessage(cause)}`)
      })
    }, Effect.scoped)

    return VmmBackend.of({
      name: "qemu",
      arch,
      start,
      repoDiskFormat: "qcow2",
      rootDiskFormat: "qcow2",
      warm: { inputs: warmInputs, build: warmBuild }
    } satisfies VmmBackendShape)
  })

/** The Linux VMM backend: QEMU (KVM when usable, else TCG) behind the abox-vmm helper. */
export const QemuVmmLive = (options: QemuVmmOptions = {}) => Layer.effect(VmmBackend, makeQemuVmm(options))
