import * as Schema from "effect/Schema"

/**
 * An image's warm snapshot (docs/on-disk.md "Warm snapshots"): the manifest beside its state
 * file. Everything that decides whether a saved state can be restored is in it, and its key
 * (the directory's name) is a hash of those inputs (src/vmm/warmSnapshot.ts).
 */
export const WARM_MANIFEST_FORMAT = 1

export const WarmManifest = Schema.Struct({
  format: Schema.Literal(WARM_MANIFEST_FORMAT),
  key: Schema.String,
  imageDigest: Schema.String,
  qemuVersion: Schema.String,
  /** the VMM argv with placeholder file names: the device layout, machine, CPU and memory flags */
  layout: Schema.Array(Schema.String),
  cpus: Schema.Number,
  memoryMiB: Schema.Number,
  /** bytes of the state file, checked before a restore (a truncated file is refused) */
  stateBytes: Schema.Number
})
export type WarmManifest = typeof WarmManifest.Type
/** what a warm snapshot must have been made with to be restored here */
export type WarmInputs = Omit<WarmManifest, "format" | "key" | "stateBytes">

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
}
