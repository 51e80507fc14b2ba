import * as Schema from "effect/Schema"

/**
 * What the guest learns from its sealed config disk (/dev/vdb) and what the host keeps as
 * `guest-config.json`. By construction it has no field that can hold a secret: the broker
 * injects credentials on the host side, the guest only ever sees placeholders.
 */
export const GUEST_CONFIG_FORMAT = 1

export const AgentCommand = Schema.Struct({
  /** argv of a program that prints JSON lines; receives the turn text on stdin. */
  argv: Schema.Array(Schema.String).pipe(Schema.minItems(1))
})

export const GuestConfig = Schema.Struct({
  format: Schema.Literal(GUEST_CONFIG_FORMAT),
  sessionId: Schema.String,
  model: Schema.String,
  /** absent: the default agent runs the turn as a shell command in /work/repo */
  agent: Schema.optional(AgentCommand),
  /** PEM of the per-session broker CA (public certificate only) */
  brokerCaCert: Schema.optional(Schema.String),
  /**
   * names of environment variables the agent's processes get with a placeholder value
   * (credentials the broker adds on the host side); names only, never a value
   */
  placeholderEnv: Schema.optional(Schema.Array(Schema.String)),
  /** test images only: the agent ignores `shutdown` so the host's bounded kill path runs */
  ignoreShutdown: Schema.optional(Schema.Boolean)
})
export type GuestConfig = typeof GuestConfig.Type
