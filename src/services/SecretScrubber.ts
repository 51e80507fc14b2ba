import * as Context from "effect/Context"
import type * as Effect from "effect/Effect"
import * as Schema from "effect/Schema"

export const ScrubFinding = Schema.Struct({
  path: Schema.String,
  sessionId: Schema.String,
  legacy: Schema.Boolean,
  /** what kind of secret was found (never its value) */
  kinds: Schema.Array(Schema.String),
  count: Schema.Number,
  changed: Schema.Boolean
})
export type ScrubFinding = typeof ScrubFinding.Type

export const ScrubReport = Schema.Struct({
  dryRun: Schema.Boolean,
  sessionsScanned: Schema.Number,
  filesScanned: Schema.Number,
  findings: Schema.Array(ScrubFinding),
  /** files that could not be read or written, with the reason; the scrub goes on past them */
  problems: Schema.Array(Schema.Struct({ path: Schema.String, reason: Schema.String }))
})
export type ScrubReport = typeof ScrubReport.Type

/**
 * Removes leftover plaintext secrets from config.raw and guest-config.json of every session in
 * both homes. Never deletes a session or a file; idempotent; crash-safe (atomic replace).
 */
export interface SecretScrubberShape {
  readonly scrub: (options: { readonly dryRun: boolean }) => Effect.Effect<ScrubReport>
}

export class SecretScrubber extends Context.Tag("abox/SecretScrubber")<SecretScrubber, SecretScrubberShape>() {}
