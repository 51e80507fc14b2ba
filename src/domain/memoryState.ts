import * as Schema from "effect/Schema"

/**
 * A session's saved memory state (QEMU migration stream) and its manifest: what the state only
 * fits (docs/on-disk.md "State files"). The saving and restoring is src/vmm/migration.ts.
 */

/** how a state file's bytes are stored: zstd -1 (when zstd is installed), else the raw stream, sparse */
export const StateCompression = Schema.Literal("zstd", "raw")
export type StateCompression = typeof StateCompression.Type

export const StateManifest = Schema.Struct({
  format: Schema.Literal(1),
  /** `qemu-system-* --version`, first line */
  qemuVersion: Schema.String,
  /** the versioned machine type the state was saved under (e.g. pc-q35-7.2) */
  machine: Schema.String,
  /** sha256 of the VMM argv with every path left out (src/vmm/migration.ts layoutDigest) */
  layoutDigest: Schema.String,
  memoryMiB: Schema.Number,
  cpus: Schema.Number,
  /** the image (its digest) whose kernel is in the saved memory */
  imageDigest: Schema.String,
  compression: StateCompression,
  /** the state file's size on disk, in bytes */
  bytes: Schema.Number,
  savedAt: Schema.String
})
export type StateManifest = typeof StateManifest.Type

/** a state file that does not fit this VM: restoring it is refused, the session cold-boots */
export class StateMismatch extends Schema.TaggedError<StateMismatch>()("StateMismatch", {
  field: Schema.String,
  message: Schema.String
}) {}

/** this VMM backend cannot save a VM's memory (vfkit today) */
export class SnapshotUnsupported extends Schema.TaggedError<SnapshotUnsupported>()("SnapshotUnsupported", {
  backend: Schema.String,
  message: Schema.String
}) {}
