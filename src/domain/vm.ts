import type * as Duration from "effect/Duration"
import type * as Effect from "effect/Effect"
import * as Schema from "effect/Schema"
import type { CloseOutcome, GuestArch, VmmBackendName } from "./session.js"

/** What a VM is started with and what a running one gives back (the VmmBackend contract's data). */

export interface CloseBounds {
  /** after the shutdown RPC: how long the VM gets to power off by itself */
  readonly graceful: Duration.DurationInput
  /** after the helper signal (SIGTERM on Linux, SIGINT on macOS) */
  readonly signalled: Duration.DurationInput
  /** after SIGKILL, how long to wait for the reap before reporting */
  readonly killed: Duration.DurationInput
}

export interface VmSpec {
  readonly sessionId: string
  readonly sessionDir: string
  readonly arch: GuestArch
  readonly kernel: string
  readonly initrd: string
  /** guest root disk (rw, /dev/vda) */
  readonly rootDisk: string
  /** its format (default raw): qcow2 for an overlay of the golden image (QEMU only) */
  readonly rootDiskFormat?: DiskFormat | undefined
  /** sealed config disk (ro, /dev/vdb) */
  readonly configDisk: string
  /** the host end of the guest RPC channel; the host is listening on it before start */
  readonly rpcSocket: string
  readonly consoleLog: string
  readonly cpus: number
  readonly memoryMiB: number
  /** the session's locked fd (RuntimeLock): inherited by the helper so the lock lives as long as the VM */
  readonly lockFd: number
  readonly bounds: CloseBounds
  /** extra kernel command line words (tests) */
  readonly kernelArgs?: ReadonlyArray<string>
  /** the session's repository disks (src/lib/repoDisk.ts), when it has them */
  readonly repoDisks?: RepoDisks | undefined
  /**
   * the warm layout (the backend's `warm` capability; docs/on-disk.md "Warm snapshots"): no
   * config or repository disk, the guest waits for the session message (docs/protocol.md "Warm
   * open"); with `incoming`, the VM is restored from that state file instead of booting
   */
  readonly warm?: { readonly incoming?: string | undefined } | undefined
}

/**
 * The repository disks (docs/on-disk.md): `repo` is attached writable (/dev/vdc; the guest
 * mounts it on /work/repo), `base` read-only (/dev/vdd; the baseline `abox diff` compares with).
 */
export interface RepoDisks {
  readonly repo: string
  readonly repoFormat: RepoDiskFormat
  readonly base: string
}

/** qcow2: a copy-on-write overlay whose backing file is `base` (QEMU); raw: a clone of it (vfkit) */
export type RepoDiskFormat = DiskFormat

/** a disk image's format as QEMU names it */
export type DiskFormat = "raw" | "qcow2"

export interface VmExit {
  readonly exitCode: number | null
  readonly signal: string | null
}

export interface VmHandle {
  readonly backend: VmmBackendName
  /** pid of the helper (abox-vmm) that owns the VMM process */
  readonly helperPid: number
  /** pid of the VMM process itself (qemu / vfkit), once known */
  readonly vmmPid: number
  /** completes when the VM has exited and been reaped */
  readonly exited: Effect.Effect<VmExit>
  /** the close outcome, once the scope's finalizer has run (for session.json) */
  readonly outcome: Effect.Effect<CloseOutcome>
  /**
   * the file holding the VMM's own output when it is not the guest console (vfkit.log: vfkit
   * says there why a VM did not start, a configuration, kernel or entitlement error)
   */
  readonly vmmLog?: string | undefined
}

export class VmmError extends Schema.TaggedError<VmmError>()("VmmError", {
  backend: Schema.String,
  reason: Schema.String,
  message: Schema.String
}) {}

export class VmmUnavailable extends Schema.TaggedError<VmmUnavailable>()("VmmUnavailable", {
  backend: Schema.String,
  message: Schema.String
}) {}
