import * as Schema from "effect/Schema"

/** the guest architectures abox boots (node's `arm64` is the guest's `aarch64`) */
export const GuestArch = Schema.Literal("x86_64", "aarch64")
export type GuestArch = typeof GuestArch.Type

export const VmmBackendName = Schema.Literal("qemu", "vz", "fake")
export type VmmBackendName = typeof VmmBackendName.Type

/** the golden image a session was cloned from, as `session.json` records it */
export const ImageIdentity = Schema.Struct({
  name: Schema.String,
  digest: Schema.String,
  kernel: Schema.optional(Schema.String),
  node: Schema.optional(Schema.String),
  agent: Schema.optional(Schema.String)
})
export type ImageIdentity = typeof ImageIdentity.Type

/** how a session's VM last closed (`session.json` `lastClose`) */
export const CloseOutcome = Schema.Struct({
  at: Schema.String,
  /**
   * graceful: it ended by itself with a clean status (the guest powered off after shutdown);
   * crashed: it ended by itself otherwise; signalled: the helper signal ended it; killed: SIGKILL
   * (the rule: src/lib/closeSequence.ts, docs/lifecycle.md)
   */
  how: Schema.Literal("graceful", "signalled", "killed", "crashed"),
  exitCode: Schema.NullOr(Schema.Number),
  signal: Schema.NullOr(Schema.String),
  /** last lines of console.log when the close was not graceful */
  consoleTail: Schema.optional(Schema.Array(Schema.String))
})
export type CloseOutcome = typeof CloseOutcome.Type

/**
 * The session's root disk (`session.json` `rootDisk`; docs/on-disk.md "The root disk"):
 * - `overlay`: `root.qcow2`, a qcow2 overlay whose backing file is the golden's read-only
 *   `root.raw` (QEMU where the filesystem cannot reflink): the session holds what it changed;
 * - `reflink`: `root.raw`, an O(1) reflink/clonefile of the golden (btrfs, XFS, APFS);
 * - `copy`: `root.raw`, a sparse-aware full copy (no reflink, and a backend that needs raw);
 * - `standalone`: `root.qcow2` made self-contained (`abox image rm --force` flattened it, and the
 *   kernel and initrd were copied beside it).
 * `backing` is the digest of the image the disk was made from. Sessions made before this field
 * have none: their `root.raw` is a full copy (`abox show` says so).
 */
export const RootDiskInfo = Schema.Struct({
  format: Schema.Literal("raw", "qcow2"),
  kind: Schema.Literal("overlay", "reflink", "copy", "standalone"),
  backing: Schema.String
})
export type RootDiskInfo = typeof RootDiskInfo.Type
