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
