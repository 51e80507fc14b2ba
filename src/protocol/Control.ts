/**
 * What the control plane of a detached session (docs/detached.md; its RpcGroup is
 * src/services/ControlRpc.ts) shares with its clients and `abox start`: a turn's request and its
 * guest text, the bounds of what crosses the socket, the ready pipe's line, and the errors of
 * the connection itself.
 */
import * as Schema from "effect/Schema"
import { TurnLimits } from "./Messages.js"

const msg = <Tag extends string, Fields extends Schema.Struct.Fields>(type: Tag, fields: Fields) =>
  Schema.Struct({ type: Schema.Literal(type), ...fields })

/** a tagged error as data: `_tag`, `message` and its other fields (what `errorFields` makes) */
export const ErrorFields = Schema.Struct(
  { _tag: Schema.String, message: Schema.String },
  Schema.Record({ key: Schema.String, value: Schema.Unknown })
)
export type ErrorFields = typeof ErrorFields.Type

/**
 * this protocol's version: 1 was the hand-written JSON lines; 2 is this RpcGroup. Both ends send
 * it in the handshake; a difference is refused there.
 */
export const CONTROL_VERSION = 2
/**
 * a line longer than this is a protocol error: requests are small, and a turn's event relays
 * one guest control frame (at most 1 MiB, whose JSON re-encodes to about its own size); a file
 * read (at most MAX_REMOTE_FILE_BYTES) is its base64
 */
export const MAX_CONTROL_LINE = 4 * 1024 * 1024

/** the client's first line: its version, and what the connection is for */
export const ControlHello = Schema.Struct({
  type: Schema.Literal("hello"),
  version: Schema.Number,
  /** absent: RPC messages follow; a port: raw bytes to 127.0.0.1:<port> in the guest */
  forward: Schema.optional(Schema.Int.pipe(Schema.between(1, 65535)))
})
export type ControlHello = typeof ControlHello.Type
/** the supervisor's answer: its version (equal to the client's), or why it refuses */
export const ControlWelcome = Schema.Union(
  Schema.Struct({ type: Schema.Literal("welcome"), version: Schema.Number }),
  Schema.Struct({ type: Schema.Literal("refused"), version: Schema.Number, error: ErrorFields })
)
export type ControlWelcome = typeof ControlWelcome.Type
export const encodeHello = Schema.encodeSync(Schema.parseJson(ControlHello))
export const decodeHello = Schema.decodeUnknownEither(Schema.parseJson(ControlHello))
export const encodeWelcome = Schema.encodeSync(Schema.parseJson(ControlWelcome))
export const decodeWelcome = Schema.decodeUnknownEither(Schema.parseJson(ControlWelcome))

/** the two ends speak different versions of this protocol (one of them is older: restart it) */
export class ControlVersionMismatch extends Schema.TaggedError<ControlVersionMismatch>()(
  "ControlVersionMismatch",
  {
    /** this end's version */
    version: Schema.Number,
    /** the other end's, when it said one */
    peer: Schema.NullOr(Schema.Number),
    message: Schema.String
  }
) {}

/**
 * One turn, of whatever kind the session runs (a shell command, or the configured agent's
 * prompt): `text` goes to the guest as `user_turn`. `env` and `cwd` make it a shell turn run
 * with those variables and in that directory; `timeoutMs` cancels it after that long.
 */
export const TurnRequest = Schema.Struct({
  text: Schema.String,
  env: Schema.optional(Schema.Record({ key: Schema.String, value: Schema.String })),
  cwd: Schema.optional(Schema.String),
  timeoutMs: Schema.optional(Schema.Int.pipe(Schema.positive())),
  /**
   * run it on a pseudo-terminal of this size in the guest (`exec -t`); the connection that sent
   * it may then send `Input`, `Resize` and `Signal` for it
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
export type TurnRequest = typeof TurnRequest.Type

/** the most bytes `files.read`/`files.write` carry over the socket (larger: copyOut/copyIn) */
export const MAX_REMOTE_FILE_BYTES = 1024 * 1024

/** characters per piece of a diff over the control socket (JSON escaping at most sextuples them) */
export const REPO_CHUNK = 256 * 1024
/** the most diff text a client accepts over the socket (a bound against a runaway patch) */
export const MAX_REMOTE_PATCH = 256 * 1024 * 1024

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
