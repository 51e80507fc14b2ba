import * as Schema from "effect/Schema"

/** a tar transfer into or out of the guest failed (the snapshot, an export) */
export class TransferFailed extends Schema.TaggedError<TransferFailed>()("TransferFailed", {
  reason: Schema.String,
  message: Schema.String
}) {}
