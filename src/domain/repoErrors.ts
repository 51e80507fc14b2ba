import * as Schema from "effect/Schema"

/**
 * Errors of the repository operations (`abox diff`, `apply`, `cp`; src/programs/repo.ts). They
 * cross the CLI and the SDK, so they are Schema.TaggedErrors (docs/exit-codes.md).
 */

/** an archive from the guest broke a rule (`..`, an absolute path, a link out, a device, too big) */
export class ArchiveRefused extends Schema.TaggedError<ArchiveRefused>()("ArchiveRefused", {
  reason: Schema.String,
  message: Schema.String
}) {}

/** `abox apply`: the source changed since the snapshot where the patch would write */
export class SourceChanged extends Schema.TaggedError<SourceChanged>()("SourceChanged", {
  source: Schema.String,
  paths: Schema.Array(Schema.String),
  message: Schema.String
}) {}

/**
 * `abox apply --3way`: the three-way merge (the snapshot as its base) left conflicts; the clean
 * paths were applied and each conflicting path holds conflict markers (nothing with `check`)
 */
export class MergeConflicts extends Schema.TaggedError<MergeConflicts>()("MergeConflicts", {
  target: Schema.String,
  paths: Schema.Array(Schema.String),
  applied: Schema.Array(Schema.String),
  message: Schema.String
}) {}

/** the patch does not apply (git apply's own refusal, with its words) */
export class PatchFailed extends Schema.TaggedError<PatchFailed>()("PatchFailed", {
  message: Schema.String
}) {}

/** a host tool the operation needs (git) is missing or failed */
export class RepoToolFailed extends Schema.TaggedError<RepoToolFailed>()("RepoToolFailed", {
  tool: Schema.String,
  message: Schema.String,
  /** what failed underneath (the tool's start, a file system call), kept for diagnosis */
  cause: Schema.optional(Schema.Defect)
}) {}

/** a path argument that is not a path inside the repository, or a missing one */
export class RepoPathInvalid extends Schema.TaggedError<RepoPathInvalid>()("RepoPathInvalid", {
  path: Schema.String,
  message: Schema.String
}) {}
