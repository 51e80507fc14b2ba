import * as Schema from "effect/Schema"

/** a tar transfer into or out of the guest failed (the snapshot, an export) */
export class TransferFailed extends Schema.TaggedError<TransferFailed>()("TransferFailed", {
  reason: Schema.String,
  message: Schema.String
}) {}

/** a host directory or file to copy in (a session's source, `cp` into it) that cannot be read as one */
export class SourceInvalid extends Schema.TaggedError<SourceInvalid>()("SourceInvalid", {
  path: Schema.String,
  message: Schema.String
}) {}
