import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as ExecutionStrategy from "effect/ExecutionStrategy"
import * as Exit from "effect/Exit"
import * as Scope from "effect/Scope"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import * as Ref from "effect/Ref"
// Raw node:fs: the accelerator record is a small file read and written in place.
import * as fs from "node:fs"
import * as path from "node:path"
import type { GuestArch } from "../domain/session.js"
import { VmmBackend, type VmmBackendShape } from "../services/VmmBackend.js"
import {
  type RestoreSpec,
  type SaveRequest,
  type VmHandle,
  VmmError,
  VmmUnavailable,
  type VmSpec
} from "../domain/vm.js"
import type { StateCompression, StateManifest } from "../domain/memoryState.js"
import * as Migration from "../vmm/migration.js"
import { type Accel, buildQemuArgv, minimalEnv, qemuBinary, WARM_HOTPLUG_PORTS } from "../vmm/argv.js"
import { kvmIsPvmOnly, kvmOpens, probeKvm } from "../vmm/kvm.js"
import { hostArch } from "../lib/arch.js"
import { ensureSocketDir, rpcSocketPath, sessionSocketPath } from "../lib/socketPath.js"
import { fallbackSignalFor, superviseHelper } from "../vmm/supervisor.js"
import { SESSION_FILES } from "../domain/sessionLayout.js"
import { findExecutable } from "../lib/executable.js"
import * as CommandExecutor from "@effect/platform/CommandExecutor"
// the Linux backend's own process executor (the KVM probe): a host layer, whoever builds it
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import type * as net from "node:net"
import * as Deferred from "effect/Deferred"
import { listenUnixServer } from "../lib/unixServer.js"
import { WARM_READY } from "../protocol/Messages.js"
import type { WarmBuildSpec } from "../domain/warm.js"

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
    // the KVM probe's QEMU runs through Command
    const executor = yield* CommandExecutor.CommandExecutor

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
        // a record made before the kvm_pvm module was loaded says kvm: not trusted on a PVM-only host
        const trusted = Option.filter(remembered, (cached) => cached.accel !== "kvm" || !kvmIsPvmOnly())
        if (wanted !== "auto") accel = wanted
        else if (Option.isSome(trusted)) accel = trusted.value.accel
        else if (kvmIsPvmOnly()) {
          accel = "tcg"
          note("qemu: this host's KVM is PVM, which runs only PVM guest kernels; guests run under TCG (slower)")
        } else if (!kvmOpens()) {
          accel = "tcg"
          note("qemu: /dev/kvm is not usable here; guests run under TCG (slower)")
        } else if (
          yield* Effect.provideService(probeKvm(qemu, arch), CommandExecutor.CommandExecutor, executor)
        )
          accel = "kvm"
        else {
          accel = "tcg"
          note("qemu: /dev/kvm opens but a KVM VM does not start on this host; guests run under TCG (slower)")
        }
        if (wanted === "auto" && Option.isNone(trusted) && options.accelCache !== undefined) {
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

    const qemuPath = Effect.suspend(() => {
      const qemu = findExecutable(binary)
      return qemu === undefined
        ? Effect.fail(
            new VmmUnavailable({
              backend: "qemu",
              message: `${binary} is not installed (apt-get install qemu-system-${arch === "x86_64" ? "x86" : "arm"})`
            })
          )
        : Effect.succeed(qemu)
    })
    const machineAlias = arch === "x86_64" ? "q35" : "virt"
    const qemuVersionRef = yield* Ref.make(Option.none<string>())
    const version = (qemu: string) =>
      Effect.flatMap(Ref.get(qemuVersionRef), (known) =>
        Option.isSome(known)
          ? Effect.succeed(known.value)
          : Migration.qemuVersion(qemu).pipe(
              Effect.tap((v) => Ref.set(qemuVersionRef, Option.some(v))),
              Effect.mapError((e) => vmmError("version", e.message))
            )
      )
    const layoutOf = (spec: VmSpec, accel: Accel, machine: string) =>
      Migration.layoutDigest({ ...spec, accel, machine })

    const boot = (
      spec: VmSpec,
      qemu: string,
      accel: Accel,
      restore?: {
        readonly machine: string
        readonly statePath: string
        readonly compression: StateCompression
      }
    ) =>
      Effect.gen(function* () {
        // <dir>/qmp.sock, or a short path where that is too long for a unix socket
        const qmpSocket = sessionSocketPath(spec.sessionDir, SESSION_FILES.qmpSocket)
        yield* ensureSocketDir(qmpSocket).pipe(Effect.mapError((e) => vmmError("qmp", e.message)))
        yield* Effect.sync(() => fs.rmSync(qmpSocket, { force: true }))
        const args = buildQemuArgv({
          ...spec,
          accel,
          qmpSocket,
          ...(restore === undefined ? {} : { machine: restore.machine, incoming: true })
        })
        const handle = yield* superviseHelper({
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
        const saveState = Effect.fn("QemuVmm.saveState")(function* (request: SaveRequest) {
          const qemuVersion = yield* version(qemu)
          const saved = yield* Migration.saveState({
            qmpSocket,
            statePath: request.statePath,
            then: request.then,
            compression: request.compression,
            machineAlias,
            whileStopped:
              request.snapshotDisks === undefined || request.snapshotDisks.length === 0
                ? undefined
                : (qmp) => Migration.snapshotDrives(qmp, request.snapshotDisks ?? [])
          }).pipe(Effect.mapError((e) => vmmError(`save: ${e.step}`, e.message)))
          return {
            format: 1,
            qemuVersion,
            machine: saved.machine,
            layoutDigest: layoutOf(spec, accel, saved.machine),
            memoryMiB: spec.memoryMiB,
            cpus: spec.cpus,
            imageDigest: request.imageDigest,
            compression: saved.compression,
            bytes: saved.bytes,
            savedAt: new Date().toISOString()
          } satisfies StateManifest
        })
        if (restore !== undefined) {
          yield* Migration.restoreState({
            qmpSocket,
            statePath: restore.statePath,
            compression: restore.compression,
            qemuExited: Effect.map(Effect.timeoutOption(handle.exited, Duration.zero), Option.isSome)
          }).pipe(Effect.mapError((e) => vmmError(`restore: ${e.step}`, e.message)))
          yield* Effect.logDebug(`restore: ${restore.compression} state loaded, the VM runs`)
          // a warm snapshot's VM runs without the session's disks: they go into its free slots
          if (spec.warm === true && spec.plugged !== true && spec.repoDisks !== undefined) {
            yield* Migration.plugRepoDisks(qmpSocket, {
              ...spec.repoDisks,
              ports: WARM_HOTPLUG_PORTS
            }).pipe(Effect.mapError((e) => vmmError(`restore: ${e.step}`, e.message)))
            yield* Effect.logDebug("restore: repository disks plugged in")
          }
        }
        return { ...handle, saveState } satisfies VmHandle
      })

    const start = Effect.fn("QemuVmm.start")(function* (spec: VmSpec) {
      const qemu = yield* qemuPath
      const accel = yield* chooseAccel(qemu)
      return yield* boot(spec, qemu, accel)
    })

    const restore = Effect.fn("QemuVmm.restore")(function* (spec: VmSpec, state: RestoreSpec) {
      const qemu = yield* qemuPath
      const accel = yield* chooseAccel(qemu)
      const { manifest } = state
      yield* Migration.checkManifest(manifest, {
        qemuVersion: yield* version(qemu),
        layoutDigest: layoutOf(spec, accel, manifest.machine),
        memoryMiB: spec.memoryMiB,
        cpus: spec.cpus,
        imageDigest: state.imageDigest
      })
      // the VM's own scope: a load that fails closes that VM at once (the caller boots instead)
      const outer = yield* Effect.scope
      const scope = yield* Scope.fork(outer, ExecutionStrategy.sequential)
      return yield* boot(spec, qemu, accel, {
        machine: manifest.machine,
        statePath: state.statePath,
        compression: manifest.compression
      }).pipe(
        Scope.extend(scope),
        Effect.tapErrorCause((cause) => Scope.close(scope, Exit.failCause(cause)))
      )
    })

    /** the warm layout's argv input, paths aside (what a warm snapshot's key depends on) */
    const warmInputs = Effect.fn("QemuVmm.warm.inputs")(function* (
      image: { readonly digest: string },
      resources: { readonly cpus: number; readonly memoryMiB: number }
    ) {
      const qemu = yield* qemuPath
      const accel = yield* chooseAccel(qemu)
      return {
        imageDigest: image.digest,
        qemuVersion: yield* version(qemu),
        layoutDigest: Migration.layoutDigest({
          arch,
          accel,
          machine: machineAlias,
          rootDiskFormat: "qcow2",
          cpus: resources.cpus,
          memoryMiB: resources.memoryMiB,
          warm: true
        }),
        cpus: resources.cpus,
        memoryMiB: resources.memoryMiB
      }
    })

    /**
     * The snapshot's boot: a raw listener on the rpc socket (QEMU connects at start), the golden
     * in the warm layout, WARM_READY from the waiting agent, then the state saved (migration.ts)
     * and the VM quit. No session exists: no lock, no config, no broker.
     */
    const warmBuild = Effect.fn("QemuVmm.warm.build")(function* (spec: WarmBuildSpec) {
      const qemu = yield* qemuPath
      const accel = yield* chooseAccel(qemu)
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
      const vm = yield* boot(
        {
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
          warm: true
        },
        qemu,
        accel
      )
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
      return yield* vm.saveState({ statePath: spec.stateFile, then: "quit", imageDigest: spec.imageDigest, compression: spec.compression })
    }, Effect.scoped)

    return VmmBackend.of({
      name: "qemu",
      arch,
      start,
      restore,
      repoDiskFormat: "qcow2",
      rootDiskFormat: "qcow2",
      warm: { inputs: warmInputs, build: warmBuild }
    } satisfies VmmBackendShape)
  })

/** The Linux VMM backend: QEMU (KVM when usable, else TCG) behind the abox-vmm helper. */
export const QemuVmmLive = (options: QemuVmmOptions = {}) =>
  Layer.effect(VmmBackend, makeQemuVmm(options)).pipe(
    Layer.provide(NodeCommandExecutor.layer),
    Layer.provide(NodeFileSystem.layer)
  )
