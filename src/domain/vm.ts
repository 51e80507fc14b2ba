import type * as Duration from "effect/Duration"
import type * as Effect from "effect/Effect"
import * as Schema from "effect/Schema"
import type { SnapshotUnsupported, StateCompression, StateManifest } from "./memoryState.js"
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
   * config disk, the guest waits for the session message (docs/protocol.md "Warm open"); the
   * repository disks (`repoDisks`) are not on the VMM's command line but hot-plugged once the VM
   * runs (VmmBackend.restore of a warm state)
   */
  readonly warm?: boolean | undefined
  /** the warm layout with `repoDisks` on the VMM's command line, in the slots a warm Open plugs */
  readonly plugged?: boolean | undefined
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

/** a VM started from a saved memory state instead of booted (VmmBackend.restore) */
export interface RestoreSpec {
  readonly statePath: string
  /** the state's manifest; a state that does not fit the VM is refused (StateMismatch) */
  readonly manifest: StateManifest
  /** the session's image digest now (its kernel must be the one in the saved memory) */
  readonly imageDigest: string
}

/** what VmHandle.saveState writes and how the VM goes on */
export interface SaveRequest {
  readonly statePath: string
  /** quit: the VM ends (suspend); cont: it runs on (fork of a running session) */
  readonly then: "quit" | "cont"
  readonly imageDigest: string
  /** how the state is stored (default: zstd where installed, src/vmm/migration.ts) */
  readonly compression?: StateCompression | undefined
  /**
   * while the VM is stopped, before its memory is saved: each drive goes on writing to `overlay`
   * (made beforehand over what the drive wrote so far, which is frozen from then on;
   * `blockdev-snapshot-sync`, a fork of a running session)
   */
  readonly snapshotDisks?: ReadonlyArray<{ readonly drive: "root" | "repo"; readonly overlay: string }> | undefined
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
  /** save the VM's memory and device state (QEMU); absent or SnapshotUnsupported: this backend cannot */
  readonly saveState?: (request: SaveRequest) => Effect.Effect<StateManifest, VmmError | SnapshotUnsupported>
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
