/**
 * The control protocol of a detached session (docs/detached.md): JSON lines over the session's
 * control socket (`control.sock`, 0600). A client opens a connection and sends one request line;
 * what follows depends on it (`turn`: events until `turn_end`, the client may send `cancel`;
 * `attach`: every turn's events, an attached typist sends `turn` lines; `forward`: after
 * `forward_ok` the connection carries raw bytes). Every line is Schema-decoded on both ends.
 */
import * as Schema from "effect/Schema"
import { AgentEvent, Hello, TurnLimits, TurnSignalName } from "./Messages.js"

/** this protocol's version, in `status` */
export const CONTROL_VERSION = 1
/**
 * a line longer than this is a protocol error: requests are small, and an event relays one guest
 * control frame (at most MAX_FRAME_PAYLOAD, 1 MiB, whose JSON re-encodes to about its own size)
 */
export const MAX_CONTROL_LINE = 2 * 1024 * 1024

const msg = <Tag extends string, Fields extends Schema.Struct.Fields>(type: Tag, fields: Fields) =>
  Schema.Struct({ type: Schema.Literal(type), ...fields })

// ---- client → supervisor ----
export const StatusRequest = msg("status", {})
/**
 * One turn, of whatever kind the session runs (a shell command, or the configured agent's
 * prompt): `text` goes to the guest as `user_turn`. `env` and `cwd` make it a shell turn run
 * with those variables and in that directory; `timeoutMs` cancels it after that long.
 */
export const TurnRequest = msg("turn", {
  text: Schema.String,
  env: Schema.optional(Schema.Record({ key: Schema.String, value: Schema.String })),
  cwd: Schema.optional(Schema.String),
  timeoutMs: Schema.optional(Schema.Int.pipe(Schema.positive())),
  /**
   * run it on a pseudo-terminal of this size in the guest (`exec -t`); the connection that sent
   * it may then send `input`, `resize` and `signal` lines for it
   */
  tty: Schema.optional(
    Schema.Struct({
      rows: Schema.Int.pipe(Schema.between(1, 0xffff)),
      cols: Schema.Int.pipe(Schema.between(1, 0xffff)),
      term: Schema.optional(Schema.String.pipe(Schema.pattern(/^[A-Za-z0-9._+-]{1,64}$/)))
    })
  ),
  /** absent or "shell": a shell command (or the agent command); "prompt": the model agent (no env/cwd) */
  mode: Schema.optional(Schema.Literal("shell", "prompt")),
  /** a prompt turn's own max steps and max cost (protocol `user_turn.limits`) */
  limits: Schema.optional(TurnLimits)
})
/** a tty turn's typed bytes (base64), from the connection that started it */
export const InputRequest = msg("input", {
  data: Schema.String.pipe(Schema.pattern(/^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$/))
})
/** the tty turn's terminal changed size */
export const ResizeRequest = msg("resize", {
  rows: Schema.Int.pipe(Schema.between(1, 0xffff)),
  cols: Schema.Int.pipe(Schema.between(1, 0xffff))
})
/** a signal to the tty turn's command (protocol turn_signal's fixed set) */
export const SignalRequest = msg("signal", { signal: TurnSignalName })
/** cancel the turn this connection started */
export const CancelRequest = msg("cancel", {})
/** watch every turn; `type: true` asks to be the one client that types (granted if free) */
export const AttachRequest = msg("attach", { typist: Schema.Boolean })
export const StopRequest = msg("stop", {
  /** save the VM's memory first (src/programs/suspend.ts): the next start restores it */
  suspend: Schema.optional(Schema.Boolean)
})
/** a byte stream to 127.0.0.1:<port> in the guest */
export const ForwardRequest = msg("forward", { port: Schema.Int.pipe(Schema.between(1, 65535)) })

/**
 * A repository operation run by the supervisor on its connection (docs/detached.md "Repository
 * operations"): the same programs as on a stopped session. Host paths are absolute (the client
 * resolves them); the supervisor, the same user on the same host, reads and writes them itself.
 */
/** the most bytes `files.read`/`files.write` carry over the socket (larger: copyOut/copyIn) */
export const MAX_REMOTE_FILE_BYTES = 1024 * 1024
export const RepoOp = Schema.Union(
  Schema.Struct({
    op: Schema.Literal("diff"),
    stat: Schema.optional(Schema.Boolean),
    paths: Schema.optional(Schema.Array(Schema.String))
  }),
  Schema.Struct({
    op: Schema.Literal("apply"),
    to: Schema.String,
    check: Schema.optional(Schema.Boolean),
    threeWay: Schema.optional(Schema.Boolean),
    paths: Schema.optional(Schema.Array(Schema.String))
  }),
  Schema.Struct({
    op: Schema.Literal("copy_out"),
    guestPath: Schema.String,
    hostPath: Schema.String,
    includeGit: Schema.optional(Schema.Boolean)
  }),
  Schema.Struct({ op: Schema.Literal("copy_in"), hostPath: Schema.String, guestDir: Schema.String }),
  /** one file's bytes: `repo_data` pieces of base64, then `repo_done` */
  Schema.Struct({ op: Schema.Literal("read"), path: Schema.String }),
  /** one file written (base64, at most MAX_REMOTE_FILE bytes decoded) with its permission bits */
  Schema.Struct({
    op: Schema.Literal("write"),
    path: Schema.String,
    data: Schema.String.pipe(Schema.maxLength(Math.ceil(MAX_REMOTE_FILE_BYTES / 3) * 4)),
    mode: Schema.optional(Schema.Int.pipe(Schema.between(0, 0o7777)))
  }),
  /** the entries under a directory: `repo_done` with `entries` */
  Schema.Struct({ op: Schema.Literal("list"), path: Schema.optional(Schema.String) })
)
export type RepoOp = typeof RepoOp.Type
export const RepoRequest = msg("repo", { request: RepoOp })

export const ControlRequest = Schema.Union(
  StatusRequest,
  TurnRequest,
  CancelRequest,
  AttachRequest,
  StopRequest,
  ForwardRequest,
  InputRequest,
  ResizeRequest,
  SignalRequest,
  RepoRequest
)
export type ControlRequest = typeof ControlRequest.Type
export type TurnRequest = typeof TurnRequest.Type

// ---- supervisor → client ----
export const StatusReply = msg("status", {
  version: Schema.Number,
  sessionId: Schema.String,
  pid: Schema.Number,
  /** ISO time the supervisor became ready */
  started: Schema.String,
  /** connected clients, this one included */
  clients: Schema.Number,
  /** the turn running now, if any */
  turn: Schema.NullOr(Schema.Number),
  hello: Hello,
  /** when it closes itself after no client and no turn (ms), if ever */
  idleTimeoutMs: Schema.NullOr(Schema.Number)
})
export type StatusReply = typeof StatusReply.Type
/** a turn began (to its starter, and to every watcher with its text) */
export const TurnStarted = msg("turn_started", {
  turn: Schema.Number,
  text: Schema.String,
  /** to an attached client: this client typed it */
  mine: Schema.optional(Schema.Boolean)
})
export const TurnEventMsg = msg("event", { turn: Schema.Number, event: AgentEvent })
export const TurnEnded = msg("turn_end", {
  turn: Schema.Number,
  exitCode: Schema.NullOr(Schema.Number),
  signal: Schema.NullOr(Schema.String),
  cancelled: Schema.Boolean,
  /** cancelled by the request's timeoutMs */
  timedOut: Schema.Boolean
})
export type TurnEnded = typeof TurnEnded.Type
export const Attached = msg("attached", {
  /** this client types (its `turn` lines are run); false: it watches */
  typist: Schema.Boolean,
  /**
   * what a typed line is in this session (`!cmd` is always a shell command): "prompt" for the
   * model agent, "shell" when the session has an agent command (`--agent`); absent: "prompt"
   */
  lines: Schema.optional(Schema.Literal("prompt", "shell"))
})
export const Stopping = msg("stopping", { pid: Schema.Number })
export const ForwardOk = msg("forward_ok", { port: Schema.Number })
/** a tagged error as data: `_tag`, `message` and its other fields (what `errorFields` makes) */
export const ErrorFields = Schema.Struct(
  { _tag: Schema.String, message: Schema.String },
  Schema.Record({ key: Schema.String, value: Schema.Unknown })
)
export type ErrorFields = typeof ErrorFields.Type
/** a typed error (its `_tag` is the tag the CLI maps to an exit code) */
export const ControlErrorMsg = msg("error", { error: ErrorFields })

/** a piece of a repository operation's text (a diff), in order; at most REPO_CHUNK characters */
export const RepoData = msg("repo_data", { data: Schema.String })
/** a repository operation's end: what it did (apply: `paths`; cp: `files`, `bytes`, cp out: `path`) */
export const RepoDone = msg("repo_done", {
  paths: Schema.optional(Schema.Array(Schema.String)),
  files: Schema.optional(Schema.Number),
  bytes: Schema.optional(Schema.Number),
  path: Schema.optional(Schema.String),
  /** list: the entries */
  entries: Schema.optional(
    Schema.Array(
      Schema.Struct({
        path: Schema.String,
        type: Schema.Literal("file", "directory", "symlink"),
        size: Schema.Number,
        mode: Schema.Number
      })
    )
  )
})
export type RepoDone = typeof RepoDone.Type
/** characters per `repo_data` line: JSON escaping at most sextuples them, below MAX_CONTROL_LINE */
export const REPO_CHUNK = 256 * 1024
/** the most diff text a client accepts over the socket (a bound against a runaway patch) */
export const MAX_REMOTE_PATCH = 256 * 1024 * 1024

export const ControlReply = Schema.Union(
  StatusReply,
  TurnStarted,
  TurnEventMsg,
  TurnEnded,
  Attached,
  Stopping,
  ForwardOk,
  ControlErrorMsg,
  RepoData,
  RepoDone
)
export type ControlReply = typeof ControlReply.Type

export const encodeRequest = Schema.encodeSync(Schema.parseJson(ControlRequest))
export const decodeRequest = Schema.decodeUnknownEither(Schema.parseJson(ControlRequest))
export const encodeReply = Schema.encodeSync(Schema.parseJson(ControlReply))
export const decodeReply = Schema.decodeUnknownEither(Schema.parseJson(ControlReply))

/** what `abox start` reads from the supervisor it spawned (one line on the ready pipe) */
export const ReadyLine = Schema.Union(
  msg("ready", { sessionId: Schema.String, pid: Schema.Number, socket: Schema.String }),
  msg("failed", { error: ErrorFields })
)
export type ReadyLine = typeof ReadyLine.Type
export const encodeReadyLine = Schema.encodeSync(Schema.parseJson(ReadyLine))
export const decodeReadyLine = Schema.decodeUnknownEither(Schema.parseJson(ReadyLine))

/** a tagged error as data: its own fields, JSON-safe (stack and cause left out) */
export const errorFields = (error: { readonly _tag: string; readonly message?: unknown }): ErrorFields => {
  const fields: Record<string, unknown> = {}
  for (const [key, value] of Object.entries(error)) {
    if (key === "stack" || key === "cause") continue
    try {
      fields[key] = JSON.parse(JSON.stringify(value)) as unknown
    } catch {
      fields[key] = String(value)
    }
  }
  const message = typeof error.message === "string" && error.message !== "" ? error.message : error._tag
  return { ...fields, _tag: error._tag, message }
}

// ---- errors ----

/** no supervisor serves this session (never started, stopped, or its socket is stale) */
export class SessionNotRunning extends Schema.TaggedError<SessionNotRunning>()("SessionNotRunning", {
  sessionId: Schema.String,
  message: Schema.String
}) {}

/** the control connection failed or the other end broke the protocol */
export class ControlError extends Schema.TaggedError<ControlError>()("ControlError", {
  reason: Schema.String,
  message: Schema.String
}) {}

/** the supervisor refused a request (its reply `error`, with the tag it gave) */
export class ControlRefused extends Schema.TaggedError<ControlRefused>()("ControlRefused", {
  tag: Schema.String,
  message: Schema.String
}) {}

/** POSIX single quotes: the text as one shell word */
export const shellQuote = (text: string): string => `'${text.replaceAll("'", `'\\''`)}'`

const ENV_NAME = /^[A-Za-z_][A-Za-z0-9_]*$/

/** the guest turn text for a request: `text` as is, or wrapped with its env and cwd as a shell turn */
export const turnText = (request: TurnRequest): string | { readonly invalid: string } => {
  const env = Object.entries(request.env ?? {})
  const bad = env.find(([name]) => !ENV_NAME.test(name))
  if (bad !== undefined) return { invalid: `not an environment variable name: ${bad[0]}` }
  if (request.mode === "prompt" && (env.length > 0 || request.cwd !== undefined))
    return { invalid: "a prompt turn takes no environment or working directory (they are for shell turns)" }
  if (request.mode === "prompt" && request.tty !== undefined)
    return { invalid: "a prompt turn has no terminal (-t is for shell turns)" }
  if (env.length === 0 && request.cwd === undefined) return request.text
  const exports = env.map(([name, value]) => `export ${name}=${shellQuote(value)}\n`).join("")
  const cd = request.cwd !== undefined ? `cd ${shellQuote(request.cwd)} || exit 126\n` : ""
  return `${exports}${cd}${request.text}`
}
