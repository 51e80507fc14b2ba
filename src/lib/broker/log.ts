import * as FileSystem from "@effect/platform/FileSystem"
import * as Effect from "effect/Effect"
import * as Schema from "effect/Schema"

/**
 * broker.log: one JSON object per line, in the session directory, mode 0600. Never a secret
 * value: `credential` only says whether a header was injected.
 */
export const BrokerLogEntry = Schema.Struct({
  time: Schema.String,
  turn: Schema.optional(Schema.Number),
  channel: Schema.Number,
  /** `open`: the CONNECT decision; `request`: one HTTP request on a credential host; `close`: totals */
  event: Schema.Literal("open", "request", "close"),
  host: Schema.String,
  port: Schema.Number,
  decision: Schema.Literal("allow", "deny"),
  reason: Schema.optional(Schema.String),
  /** the address actually dialled */
  address: Schema.optional(Schema.String),
  mode: Schema.optional(Schema.Literal("passthrough", "terminate")),
  credential: Schema.Boolean,
  method: Schema.optional(Schema.String),
  status: Schema.optional(Schema.Number),
  bytesUp: Schema.optional(Schema.Number),
  bytesDown: Schema.optional(Schema.Number),
  durationMs: Schema.optional(Schema.Number)
})
export type BrokerLogEntry = typeof BrokerLogEntry.Type

const encodeLine = Schema.encodeSync(Schema.parseJson(BrokerLogEntry))
const decodeLine = Schema.decodeUnknownEither(Schema.parseJson(BrokerLogEntry))

export const BROKER_LOG_FILE = "broker.log"

/** Append-only writer, scoped; writes are serialised so lines never interleave. */
export const openBrokerLog = (path: string) =>
  Effect.gen(function* () {
    const fs = yield* FileSystem.FileSystem
    const file = yield* fs.open(path, { flag: "a", mode: 0o600 })
    // an existing file keeps its mode on open: make sure it is 0600 whatever it was
    yield* fs.chmod(path, 0o600)
    const lock = yield* Effect.makeSemaphore(1)
    const encoder = new TextEncoder()
    return (entry: BrokerLogEntry) =>
      lock
        .withPermits(1)(file.writeAll(encoder.encode(encodeLine(entry) + "\n")))
        .pipe(Effect.catchAll((error) => Effect.logWarning("broker.log write failed", error)))
  })

export interface BrokerLogRead {
  readonly entries: ReadonlyArray<BrokerLogEntry>
  /** line numbers (1-based) that did not decode; left as they are */
  readonly badLines: ReadonlyArray<number>
}

/** Read and decode a session's broker.log; a missing file is an empty log. */
export const readBrokerLog = Effect.fn("BrokerLog.read")(function* (path: string) {
  const fs = yield* FileSystem.FileSystem
  const exists = yield* fs.exists(path)
  if (!exists) return { entries: [], badLines: [] } satisfies BrokerLogRead
  const text = yield* fs.readFileString(path)
  const entries: Array<BrokerLogEntry> = []
  const badLines: Array<number> = []
  text.split("\n").forEach((line, index) => {
    if (line.trim() === "") return
    const decoded = decodeLine(line)
    if (decoded._tag === "Right") entries.push(decoded.right)
    else badLines.push(index + 1)
  })
  return { entries, badLines } satisfies BrokerLogRead
})

/** One human line per entry, for `abox logs --broker`. */
export const formatBrokerLogEntry = (e: BrokerLogEntry): string => {
  const parts = [
    e.time,
    e.turn === undefined ? "turn -" : `turn ${e.turn}`,
    `#${e.channel}`,
    e.event.padEnd(7),
    e.decision.toUpperCase().padEnd(5),
    `${e.host}:${e.port}`
  ]
  if (e.reason !== undefined) parts.push(`(${e.reason})`)
  if (e.mode !== undefined) parts.push(e.mode)
  if (e.address !== undefined) parts.push(`via ${e.address}`)
  if (e.method !== undefined) parts.push(e.method)
  if (e.status !== undefined) parts.push(String(e.status))
  if (e.credential) parts.push("credential injected")
  if (e.bytesUp !== undefined || e.bytesDown !== undefined)
    parts.push(`up ${e.bytesUp ?? 0} B, down ${e.bytesDown ?? 0} B`)
  if (e.durationMs !== undefined) parts.push(`${e.durationMs} ms`)
  return parts.join("  ")
}

export const formatBrokerLog = (read: BrokerLogRead): string =>
  [
    ...read.entries.map((e) => formatBrokerLogEntry(e)),
    ...(read.badLines.length > 0
      ? [`(${read.badLines.length} unreadable line(s): ${read.badLines.join(", ")})`]
      : [])
  ].join("\n")
