import * as Schema from "effect/Schema"

/** Protocol v4: see docs/protocol.md. One protocol number per connection, checked in hello. */
export const PROTOCOL_VERSION = 4
/** The oldest guest protocol this host speaks. */
export const MIN_GUEST_PROTOCOL = 4

/** standard base64 (RFC 4648 §4, padded) */
const Base64 = Schema.String.pipe(Schema.pattern(/^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/))

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
  Schema.Struct({ kind: Schema.Literal("status"), message: Schema.String })
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
  features: Schema.optional(Schema.Array(Schema.String))
})

/** hello.features: the guest understands export_begin (and keeps a baseline) */
export const FEATURE_EXPORT = "export"
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
export const UserTurn = msg("user_turn", { turn: Schema.Number, text: Schema.String })
export const Cancel = msg("cancel", { turn: Schema.Number })
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
  TunnelAccept,
  TunnelDeny,
  TunnelClose,
  ErrorMsg,
  ForwardOpen,
  ForwardAccept
)
export type ControlMessage = typeof ControlMessage.Type
export type HelloMessage = typeof Hello.Type
