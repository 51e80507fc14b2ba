import * as Context from "effect/Context"
import type * as Effect from "effect/Effect"
import type * as Scope from "effect/Scope"
import type { GuestArch, VmmBackendName } from "../domain/session.js"
import type { SnapshotUnsupported, StateMismatch } from "../domain/memoryState.js"
import type {
  DiskFormat,
  RepoDiskFormat,
  RestoreSpec,
  VmHandle,
  VmmError,
  VmmUnavailable,
  VmSpec
} from "../domain/vm.js"
import type { StateManifest } from "../domain/memoryState.js"
import type { WarmBuildSpec, WarmInputs } from "../domain/warm.js"

/**
 * Warm snapshots of an image (QEMU; absent where the VMM cannot save and restore a VM's memory,
 * vfkit today): Open restores one (`restore` with a VmSpec in the warm layout) instead of
 * booting (docs/on-disk.md "Warm snapshots").
 */
export interface WarmSnapshotShape {
  /** what a snapshot of this image at these resources must have been made with, on this host */
  readonly inputs: (
    image: { readonly digest: string },
    resources: { readonly cpus: number; readonly memoryMiB: number }
  ) => Effect.Effect<WarmInputs, VmmError | VmmUnavailable>
  /** boots the golden in the warm layout, waits for the guest to wait, saves its state, ends it */
  readonly build: (spec: WarmBuildSpec) => Effect.Effect<StateManifest, VmmError | VmmUnavailable>
}

/**
 * Starts a VM. The handle is scoped: its finalizer is the VMM half of Close (bounded wait for
 * the guest to power off → helper signal → bounded wait → SIGKILL → wait/reap). The GuestRpc
 * shutdown is acquired after the VM, so it runs first.
 */
export interface VmmBackendShape {
  readonly name: VmmBackendName
  readonly arch: GuestArch
  readonly start: (spec: VmSpec) => Effect.Effect<VmHandle, VmmError | VmmUnavailable, Scope.Scope>
  /**
   * start the VM from a saved memory state (VmHandle.saveState) instead of booting it: processes
   * go on where they were. StateMismatch (checked before anything starts) or a VmmError (the load
   * failed; that VM is closed again): the caller boots instead. Absent: SnapshotUnsupported.
   */
  readonly restore?: (
    spec: VmSpec,
    state: RestoreSpec
  ) => Effect.Effect<VmHandle, VmmError | VmmUnavailable | StateMismatch | SnapshotUnsupported, Scope.Scope>
  /** the repository disk format this backend attaches; absent: none (the snapshot goes as a tar) */
  readonly repoDiskFormat?: RepoDiskFormat
  /**
   * qcow2: the backend attaches a qcow2 root, so Open makes it an overlay of the golden where
   * the filesystem cannot reflink; absent or raw: a raw root (a reflink or a sparse copy)
   */
  readonly rootDiskFormat?: DiskFormat
  /** absent: every Open boots (the backend cannot restore a warm snapshot) */
  readonly warm?: WarmSnapshotShape
}

export class VmmBackend extends Context.Tag("abox/VmmBackend")<VmmBackend, VmmBackendShape>() {}
