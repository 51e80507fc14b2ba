import * as Schema from "effect/Schema"

/**
 * The supervisor ↔ abox-vmm contract. The supervisor writes one `HelperSpec` JSON line on the
 * helper's stdin; the helper answers with `HelperEvent` JSON lines on stdout. fd 3 is the
 * liveness pipe (EOF = the supervisor died), fd 4 the session's locked fd (passed on to the
 * VMM so the lock lives exactly as long as the VM).
 */
export const LIVENESS_FD = 3
export const LOCK_FD = 4

export const HelperSpec = Schema.Struct({
  /** VMM binary and its argv (no secrets: see argv.ts) */
  command: Schema.String,
  args: Schema.Array(Schema.String),
  env: Schema.Record({ key: Schema.String, value: Schema.String }),
  consoleLog: Schema.String,
  /** console.log is kept at most this big (the tail survives) */
  consoleMaxBytes: Schema.Number,
  /** QMP socket for quit; absent → signals only */
  qmpSocket: Schema.optional(Schema.String),
  /** vfkit's RESTful API socket: POST /vm/state Stop, then HardStop, before the signal fallback */
  restSocket: Schema.optional(Schema.String),
  /**
   * the platform's fallback signal (SIGINT on macOS, SIGTERM on Linux; default: by the helper's
   * own platform): the supervisor stops the helper with it, and the helper sends it to the VMM
   */
  signal: Schema.optional(Schema.Literal("SIGINT", "SIGTERM")),
  /** the helper's own bounded stop: QMP quit → wait → SIGTERM → wait → SIGKILL */
  quitMs: Schema.Number,
  termMs: Schema.Number
})
export type HelperSpec = typeof HelperSpec.Type

export const HelperEvent = Schema.Union(
  Schema.Struct({ event: Schema.Literal("started"), pid: Schema.Number }),
  Schema.Struct({ event: Schema.Literal("stopping"), reason: Schema.String }),
  Schema.Struct({
    event: Schema.Literal("exited"),
    code: Schema.NullOr(Schema.Number),
    signal: Schema.NullOr(Schema.String)
  }),
  Schema.Struct({ event: Schema.Literal("error"), message: Schema.String })
)
export type HelperEvent = typeof HelperEvent.Type

export const decodeHelperEvent = Schema.decodeUnknownEither(Schema.parseJson(HelperEvent))
export const encodeHelperEvent = Schema.encodeSync(Schema.parseJson(HelperEvent))
export const decodeHelperSpec = Schema.decodeUnknownEither(Schema.parseJson(HelperSpec))
export const encodeHelperSpec = Schema.encodeSync(Schema.parseJson(HelperSpec))
