/**
 * The macOS VMM backend ("vz"): vfkit (Virtualization.framework) behind the abox-vmm helper,
 * arm64 guests. Same shape as QemuVmm, through the same supervisor (src/vmm/supervisor.ts): it
 * spawns the helper with the liveness pipe (fd 3) and the session's locked fd (fd 4); the helper
 * runs vfkit and stops it on request.
 *
 * Close (the scope's finalizer; the GuestRpc shutdown ran before it): bounded wait for the guest
 * to power off → SIGINT to the helper (seed 000: on macOS the helper fallback signal is SIGINT)
 * → the helper asks vfkit over its REST socket (Stop, then HardStop), then signals vfkit
 * (SIGINT: vfkit's own handler requests a stop and forces it after 5 s) → bounded wait →
 * SIGKILL to the helper and vfkit → reap; then the REST socket file is removed.
 *
 * The guest RPC channel: vfkit listens on the guest's vsock port 1024 and dials the host's
 * rpc.sock for each guest connection, where GuestRpc is already listening: the host side is the
 * same code as on Linux.
 */
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Layer from "effect/Layer"
// Raw node:fs: a stale REST socket file is removed.
import * as fs from "node:fs"
import { ensureSocketDir, maxSocketPathBytes, vfkitSocketPath } from "../lib/socketPath.js"
import { hostArch } from "../lib/arch.js"
import type { GuestArch } from "../domain/session.js"
import { VmmBackend, type VmmBackendShape } from "../services/VmmBackend.js"
import { VmmError, VmmUnavailable, type VmSpec } from "../domain/vm.js"
import { minimalEnv } from "../vmm/argv.js"
import { fallbackSignalFor, superviseHelper } from "../vmm/supervisor.js"
import { buildVfkitArgv, uncompressedKernel } from "../vmm/vfkit.js"
import { sessionFile } from "../domain/sessionLayout.js"
import { findExecutable } from "../lib/executable.js"

export interface DarwinVmmOptions {
  /** the platform whose rules apply (fallback signal, socket path limit); default process.platform */
  readonly platform?: NodeJS.Platform
  /** the vfkit executable: a path, or a name looked up on PATH (default `vfkit`; the CLI and SDK pass $ABOX_VFKIT) */
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

const vmmError = (reason: string, message: string) => new VmmError({ backend: "vz", reason, message })

export const makeDarwinVmm = (options: DarwinVmmOptions = {}) =>
  Effect.sync(() => {
    const platform = options.platform ?? process.platform
    const arch = options.arch ?? hostArch()
    const fallbackSignal = fallbackSignalFor(platform)
    const stepMs = options.stepMs ?? 1500

    const start = Effect.fn("DarwinVmm.start")(function* (spec: VmSpec) {
      const wanted = options.vfkit ?? "vfkit"
      const vfkit = findExecutable(wanted, ["/opt/homebrew/bin", "/usr/local/bin"])
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
      // the image's shipped uncompressed `Image` beside vmlinuz; an older image's vmlinuz is
      // decompressed once (Virtualization.framework boots no gzipped kernel)
      const kernel = yield* uncompressedKernel(spec.kernel, spec.sessionDir).pipe(
        Effect.mapError((error) => vmmError("kernel", error.message))
      )
      const built = buildVfkitArgv({ ...spec, kernel, restSocket })
      if (Either.isLeft(built)) return yield* vmmError("path", built.left.message)
      const args = built.right

      return yield* superviseHelper({
        backend: "vz",
        vmmName: "vfkit",
        helper: options.helper,
        helperSpec: {
          command: vfkit,
          args,
          env: minimalEnv(),
          // vfkit writes the guest serial into console.log itself (virtio-serial,logFilePath);
          // the helper keeps vfkit's own output, bounded, beside it
          consoleLog: sessionFile(spec.sessionDir, "vfkitLog"),
          consoleMaxBytes: options.vfkitLogMaxBytes ?? 1024 * 1024,
          restSocket,
          signal: fallbackSignal,
          quitMs: stepMs,
          termMs: stepMs
        },
        fallbackSignal,
        vm: spec,
        cleanup: Effect.sync(() => fs.rmSync(restSocket, { force: true }))
      })
    })

    return VmmBackend.of({ name: "vz", arch, start, repoDiskFormat: "raw" } satisfies VmmBackendShape)
  })

/** The macOS VMM backend: vfkit (Virtualization.framework) behind the abox-vmm helper. */
export const DarwinVmmLive = (options: DarwinVmmOptions = {}) =>
  Layer.effect(VmmBackend, makeDarwinVmm(options))
