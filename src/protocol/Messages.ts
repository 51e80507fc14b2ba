import * as Schema from "effect/Schema"
import { GuestConfig } from "./GuestConfig.js"

/** Protocol v4: see docs/protocol.md. One protocol number per connection, checked in hello. */
export const PROTOCOL_VERSION = 4
/** The oldest guest protocol this host speaks. */
export const MIN_GUEST_PROTOCOL = 4

/**
 * The model agent's events (a prompt turn; additive to v4, docs/protocol.md "Agent events"): an
 * older host shows them as JSON, an older guest never sends them.
 */
export const TextEvent = Schema.Struct({
  kind: Schema.Literal("text"),
  /** the assistant's answer as it streams */
  delta: Schema.String
})
export const ToolCallEvent = Schema.Struct({
  kind: Schema.Literal("tool_call"),
  id: Schema.String,
  name: Schema.String,
  input: Schema.Unknown
})
export const ToolResultEvent = Schema.Struct({
  kind: Schema.Literal("tool_result"),
  id: Schema.String,
  name: Schema.String,
  /** a process's exit status (null: killed, or a tool that runs no process) */
  exitCode: Schema.NullOr(Schema.Number),
  /** the output as the model sees it: capped, head and tail kept, the cut said */
  output: Schema.String,
  truncated: Schema.Boolean,
  /** the tool failed (refused path, no match, timeout, non-zero exit) */
  isError: Schema.Boolean,
  durationMs: Schema.Number
})
export const UsageEvent = Schema.Struct({
  kind: Schema.Literal("usage"),
  model: Schema.String,
  inputTokens: Schema.Number,
  outputTokens: Schema.Number,
  /** US dollars, when the model catalog knows the prices */
  costUsd: Schema.optional(Schema.Number)
})
export const RetryEvent = Schema.Struct({
  kind: Schema.Literal("retry"),
  /** 1 for the first retry */
  attempt: Schema.Number,
  delayMs: Schema.Number,
  reason: Schema.String
})
/** `max_cost` only for a turn whose `user_turn.limits` set `maxCostUsd` (a host that knows it) */
export const AgentEndReason = Schema.Literal("done", "max_steps", "max_cost", "cancelled", "error")
export const AgentEndEvent = Schema.Struct({
  kind: Schema.Literal("agent_end"),
  reason: AgentEndReason,
  /** model requests made in the turn */
  steps: Schema.Number,
  /** why, for `error` (401 names the host's environment variable; a broker refusal its reason) */
  message: Schema.optional(Schema.String)
})
const ModelAgentEvents = [
  TextEvent,
  ToolCallEvent,
  ToolResultEvent,
  UsageEvent,
  RetryEvent,
  AgentEndEvent
] as const

/** standard base64 (RFC 4648 §4, padded) */
const Base64 = Schema.String.pipe(
  Schema.pattern(/^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/)
)

/**
 * Output bytes of a turn. `data` is the text; when the bytes are not valid UTF-8, `base64`
 * carries them exactly and `data` is their lossy decoding (U+FFFD for invalid sequences), so a
 * host that predates `base64` still shows something. Absent `base64`: the bytes are `data` in UTF-8.
 */
const outputFields = { data: Schema.String, base64: Schema.optional(Base64) }

/** What a turn produces, as the host sees it (one `agent_event` each). */
export const AgentEvent = Schema.Union(
  Schema.Struct({ kind: Schema.Literal("stdout"), ...outputFields }),
  Schema.Struct({ kind: Schema.Literal("stderr"), ...outputFields }),
  /** a JSON line printed by a configured agent command */
  Schema.Struct({ kind: Schema.Literal("json"), value: Schema.Unknown }),
  /** agent-side notes (e.g. "turn started", "cancelling") */
  Schema.Struct({ kind: Schema.Literal("status"), message: Schema.String }),
  ...ModelAgentEvents
)
export type AgentEvent = typeof AgentEvent.Type

const msg = <Tag extends string, Fields extends Schema.Struct.Fields>(type: Tag, fields: Fields) =>
  Schema.Struct({ type: Schema.Literal(type), ...fields })

// guest → host
export const Hello = msg("hello", {
  protocol: Schema.Number,
  arch: Schema.String,
  build: Schema.String,
  /** turns remembered from /var/lib/abox/context.json */
  contextTurns: Schema.optional(Schema.Number),
  /**
   * the guest's receive window per channel (host → guest DATA), in bytes; absent: 256 KiB.
   * Never below 256 KiB, so that a host may always send the v4 default.
   */
  window: Schema.optional(Schema.Int.pipe(Schema.between(256 * 1024, 0xffffffff))),
  /**
   * the guest mounted the session's repository disk on /work/repo (and its baseline read-only):
   * the host sends no snapshot tar at Open
   */
  repoDisk: Schema.optional(Schema.Boolean),
  /**
   * host → guest message types beyond the first v4 set that this guest understands; the host
   * sends such a message only when it is listed here (`export`: export_begin)
   */
  features: Schema.optional(Schema.Array(Schema.String)),
  /**
   * the highest channel id the host has opened on this guest so far (a hello that answers
   * `resumed`): the host opens above it, since ids are never reused
   */
  hostChannel: Schema.optional(Schema.Int.pipe(Schema.between(0, 0x7fffffff)))
})

/** hello.features: the guest understands export_begin (and keeps a baseline) */
export const FEATURE_EXPORT = "export"
/** hello.features: the guest understands tty_turn, turn_input, turn_resize and turn_signal */
export const FEATURE_TTY = "tty"
/**
 * hello.features: the guest understands `user_turn.output`: a shell turn's stdout and stderr go
 * as records on that data channel (protocol/TurnOutput.ts) under its credit, not as events
 */
export const FEATURE_OUTPUT = "output"
/** hello.features: the guest honours `user_turn.limits` (a prompt turn's max steps and max cost) */
export const FEATURE_LIMITS = "limits"
/**
 * hello.features: the guest answers `resumed` with a new hello and ready; the host saves the
 * memory of such a guest only (`abox suspend`, `abox fork`)
 */
export const FEATURE_RESUME = "resume"
export const Ready = msg("ready", {})
export const AgentEventMsg = msg("agent_event", { turn: Schema.Number, event: AgentEvent })
export const TurnEnd = msg("turn_end", {
  turn: Schema.Number,
  exitCode: Schema.NullOr(Schema.Number),
  signal: Schema.NullOr(Schema.String),
  cancelled: Schema.Boolean
})
export const TransferEnd = msg("transfer_end", {
  channel: Schema.Number,
  files: Schema.Number,
  bytes: Schema.Number
})
export const TunnelOpen = msg("tunnel_open", {
  channel: Schema.Number,
  host: Schema.String,
  port: Schema.Number
})

// host → guest
/** a prompt turn's own limits (FEATURE_LIMITS), over the session's `maxSteps` */
export const TurnLimits = Schema.Struct({
  /** model requests at most */
  maxSteps: Schema.optional(Schema.Int.pipe(Schema.between(1, 1000))),
  /** US dollars: the turn stops once its cost (usage × the catalog's prices) reaches this */
  maxCostUsd: Schema.optional(Schema.Number.pipe(Schema.positive(), Schema.finite()))
})
export type TurnLimits = typeof TurnLimits.Type
export const UserTurn = msg("user_turn", {
  turn: Schema.Number,
  text: Schema.String,
  /** absent or "shell": a shell command (or the configured agent command); "prompt": the model agent */
  mode: Schema.optional(Schema.Literal("shell", "prompt")),
  /**
   * (FEATURE_OUTPUT) a host-opened (even) data channel for the turn's stdout/stderr records; the
   * guest sends its EOF before turn_end (at once when the turn's output goes as events instead)
   */
  output: Schema.optional(Schema.Number),
  /** (FEATURE_LIMITS) prompt turns only */
  limits: Schema.optional(TurnLimits)
})
export const Cancel = msg("cancel", { turn: Schema.Number })
/** a terminal dimension (NAWS carries 16 bits) */
const TermSize = Schema.Int.pipe(Schema.between(1, 0xffff))
/**
 * host → guest (FEATURE_TTY): a shell command on a pseudo-terminal of `rows`×`cols`; its output
 * is `stdout` events (the terminal's bytes), then turn_end as for user_turn
 */
export const TtyTurn = msg("tty_turn", {
  turn: Schema.Number,
  text: Schema.String,
  rows: TermSize,
  cols: TermSize,
  /** the client's TERM */
  term: Schema.optional(Schema.String.pipe(Schema.pattern(/^[A-Za-z0-9._+-]{1,64}$/)))
})
/** host → guest (FEATURE_TTY): bytes typed on the client's terminal, for a running tty turn */
export const TurnInput = msg("turn_input", { turn: Schema.Number, data: Base64 })
/** host → guest (FEATURE_TTY): the client's terminal changed size */
export const TurnResize = msg("turn_resize", { turn: Schema.Number, rows: TermSize, cols: TermSize })
/** the signals a tty turn's command may be sent (turn_signal) */
export const TurnSignalName = Schema.Literal(
  "SIGINT",
  "SIGTERM",
  "SIGHUP",
  "SIGQUIT",
  "SIGKILL",
  "SIGUSR1",
  "SIGUSR2"
)
/** host → guest (FEATURE_TTY): a signal to a running tty turn's command */
export const TurnSignal = msg("turn_signal", { turn: Schema.Number, signal: TurnSignalName })
export const TransferBegin = msg("transfer_begin", {
  channel: Schema.Number,
  format: Schema.Literal("tar"),
  target: Schema.String,
  /** Open's snapshot: once extracted, the guest keeps a copy as the baseline (abox diff) */
  baseline: Schema.optional(Schema.Boolean)
})
/** the trees the guest can send back: the repository, or the baseline recorded at Open */
export const ExportTree = Schema.Literal("repo", "baseline")
export type ExportTree = typeof ExportTree.Type
/**
 * host → guest: send a tar of `paths` (relative to the tree's root; empty = the whole tree,
 * less the top-level names in `exclude`) on `channel` (even, host-chosen), then EOF and
 * `transfer_end`; a failure is `error {code: "export_failed", channel}`.
 */
export const ExportBegin = msg("export_begin", {
  channel: Schema.Number,
  tree: ExportTree,
  paths: Schema.Array(Schema.String),
  exclude: Schema.Array(Schema.String),
  /**
   * only the files and links that differ between the repository and the baseline (type, mode,
   * size, mtime, ctime, link target), or are on one side only; `paths` is then ignored
   */
  changed: Schema.optional(Schema.Boolean)
})
export const Shutdown = msg("shutdown", {})
/**
 * host → guest, the first message on a connection to a VM restored from its saved memory (the
 * guest never knew it stopped): the host's clock and fresh entropy. The guest sets its clock,
 * mixes the entropy into its kernel pool, and answers with a new hello (with `hostChannel`) and
 * ready; the conversation goes on from there.
 */
export const Resumed = msg("resumed", {
  unixMillis: Schema.Number,
  /** base64 of 32 to 512 random bytes */
  entropy: Schema.String.pipe(Schema.maxLength(1024)),
  /**
   * a fork's own broker CA (PEM): the guest trusts it instead of the one its config disk gave
   * at boot (the parent's)
   */
  brokerCaCert: Schema.optional(Schema.String.pipe(Schema.maxLength(16384)))
})
export const TunnelAccept = msg("tunnel_accept", { channel: Schema.Number })
export const TunnelDeny = msg("tunnel_deny", { channel: Schema.Number, reason: Schema.String })

// port forwards (host-opened, even channel ids): the guest connects to 127.0.0.1:<port> in the
// guest and answers forward_accept, or `error` (code forward_refused) naming the channel;
// either side ends one with tunnel_close
export const ForwardOpen = msg("forward_open", {
  channel: Schema.Number,
  port: Schema.Int.pipe(Schema.between(1, 65535))
})
export const ForwardAccept = msg("forward_accept", { channel: Schema.Number })

// either way
export const TunnelClose = msg("tunnel_close", { channel: Schema.Number })
export const ErrorMsg = msg("error", {
  code: Schema.String,
  message: Schema.String,
  turn: Schema.optional(Schema.Number),
  channel: Schema.optional(Schema.Number)
})

/**
 * host → guest, the first message of a warm open (docs/protocol.md "Warm open"): a guest restored
 * from its image's warm snapshot waits for its session instead of reading a config disk. It
 * carries the config (what the config disk carries: nothing secret), the host's clock (ms since
 * the epoch; the guest's clock stopped at the snapshot) and fresh entropy for the guest's pool
 * (every restore of one snapshot must differ). The guest then says hello as after a boot.
 */
/**
 * What a guest waiting for its session writes on its raw RPC port before any frame (once, at the
 * snapshot's boot): the host building the warm snapshot saves the VM when it reads it.
 */
export const WARM_READY = "abox-warm-ready\n"

export const SessionHandoff = msg("session", {
  config: GuestConfig,
  time: Schema.Number,
  entropy: Base64,
  /** the host hot-plugged the session's repository disks: wait for them, mount them as at boot */
  repoDisks: Schema.optional(Schema.Literal(true))
})

export const ControlMessage = Schema.Union(
  Hello,
  Ready,
  AgentEventMsg,
  TurnEnd,
  TransferEnd,
  TunnelOpen,
  UserTurn,
  Cancel,
  TransferBegin,
  ExportBegin,
  Shutdown,
  Resumed,
  TunnelAccept,
  TunnelDeny,
  TunnelClose,
  ErrorMsg,
  ForwardOpen,
  ForwardAccept,
  TtyTurn,
  TurnInput,
  TurnResize,
  TurnSignal,
  SessionHandoff
)
export type ControlMessage = typeof ControlMessage.Type
export type HelloMessage = typeof Hello.Type
export type SessionHandoffMessage = typeof SessionHandoff.Type
