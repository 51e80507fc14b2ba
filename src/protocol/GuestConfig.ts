import * as Schema from "effect/Schema"

/**
 * What the guest learns from its sealed config disk (/dev/vdb) and what the host keeps as
 * `guest-config.json`. By construction it has no field that can hold a secret: the broker
 * injects credentials on the host side, the guest only ever sees placeholders.
 */
export const GUEST_CONFIG_FORMAT = 1

/** The placeholder a guest process holds instead of a credential; the broker replaces it. */
export const CREDENTIAL_PLACEHOLDER = "abox-placeholder"

export const AgentCommand = Schema.Struct({
  /** argv of a program that prints JSON lines; receives the turn text on stdin. */
  argv: Schema.Array(Schema.String).pipe(Schema.minItems(1))
})

/**
 * The model a prompt turn talks to, resolved on the host from the model catalog: secretless (the
 * key is added by the broker; `hostVariable` names the host's variable for messages only: its
 * field name says nothing of keys so that the secret scrubber, which redacts key-named fields, leaves
 * the config of a running session alone).
 */
export const ModelSpec = Schema.Struct({
  provider: Schema.Literal("anthropic", "openai"),
  /** openai only: `chat` speaks the Chat Completions API (absent: the Responses API) */
  api: Schema.optional(Schema.Literal("responses", "chat")),
  /** the provider's model id */
  id: Schema.String,
  /** base URL: Anthropic `https://api.anthropic.com`, OpenAI (or compatible) `…/v1` */
  endpoint: Schema.String,
  /** the host's environment variable holding the key (for messages; the guest never sees a value) */
  hostVariable: Schema.optional(Schema.String),
  contextWindow: Schema.optional(Schema.Number),
  /** the most tokens one answer may take (named so that the scrubber does not take it for a token) */
  outputLimit: Schema.optional(Schema.Number),
  /** US dollars per million tokens, when known */
  inputPrice: Schema.optional(Schema.Number),
  outputPrice: Schema.optional(Schema.Number)
})
export type ModelSpec = typeof ModelSpec.Type

export const GuestConfig = Schema.Struct({
  format: Schema.Literal(GUEST_CONFIG_FORMAT),
  sessionId: Schema.String,
  model: Schema.String,
  /** absent: the default agent runs the turn as a shell command in /work/repo */
  agent: Schema.optional(AgentCommand),
  /** PEM of the per-session broker CA (public certificate only) */
  brokerCaCert: Schema.optional(Schema.String),
  /**
   * PEM certificates of further CAs the guest's clients trust besides the system's (the policy's
   * `guestCaFiles`: a network that inspects TLS); public certificates only, checked on the host
   */
  extraCaCerts: Schema.optional(Schema.Array(Schema.String)),
  /**
   * names of environment variables the agent's processes get with a placeholder value
   * (credentials the broker adds on the host side); names only, never a value
   */
  placeholderEnv: Schema.optional(Schema.Array(Schema.String)),
  /** the resolved model alias (absent: prompt turns end with an error naming the problem) */
  modelSpec: Schema.optional(ModelSpec),
  /** model requests per prompt turn at most (default 50) */
  maxSteps: Schema.optional(Schema.Int.pipe(Schema.between(1, 1000))),
  /**
   * variables for turn processes, from the repository's environment (docs/environments.md);
   * the proxy, CA and placeholder variables are set after them and win
   */
  env: Schema.optional(
    Schema.Record({
      key: Schema.String.pipe(Schema.pattern(/^[A-Za-z_][A-Za-z0-9_]*$/)),
      value: Schema.String
    })
  ),
  /**
   * an environment's setup VM (docs/environments.md): turns run as root, the repository disk is
   * mounted read-only, and the agent keeps no conversation (its state lives in /run), so the
   * image made from this root disk starts with none
   */
  setup: Schema.optional(Schema.Boolean),
  /** test images only: the agent ignores `shutdown` so the host's bounded kill path runs */
  ignoreShutdown: Schema.optional(Schema.Boolean)
})
export type GuestConfig = typeof GuestConfig.Type
