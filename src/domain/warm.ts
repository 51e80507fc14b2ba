/**
 * An image's warm snapshot (docs/on-disk.md "Warm snapshots"): a saved memory state (its manifest
 * is src/domain/memoryState.ts's StateManifest, the one suspend writes) of the golden booted in
 * the warm layout, its agent waiting for a session. A snapshot directory's key is a hash of what
 * the state only fits (src/programs/warm.ts warmKey): another QEMU, layout, memory or CPU count
 * gives another key, so another snapshot.
 */
import type { StateCompression } from "./memoryState.js"

/** what a warm snapshot must have been made with to be restored here */
export interface WarmInputs {
  readonly imageDigest: string
  readonly qemuVersion: string
  /** src/vmm/migration.ts layoutDigest of the warm layout, with the machine family's alias */
  readonly layoutDigest: string
  readonly cpus: number
  readonly memoryMiB: number
}

/** what the backend boots to make a warm snapshot */
export interface WarmBuildSpec {
  /** a scratch directory for the VM's sockets and console */
  readonly workDir: string
  readonly kernel: string
  readonly initrd: string
  /** a qcow2 overlay of the golden: the disk the snapshot's guest mounted (sessions copy it) */
  readonly rootDisk: string
  readonly cpus: number
  readonly memoryMiB: number
  readonly stateFile: string
  readonly imageDigest: string
  readonly compression: StateCompression
}
