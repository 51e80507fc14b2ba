import type { PlatformError } from "@effect/platform/Error"
import * as FileSystem from "@effect/platform/FileSystem"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FiberId from "effect/FiberId"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import { escapeControl } from "../lib/text.js"
import { SESSION_FILES } from "../domain/sessionLayout.js"

/**
 * broker.log: one JSON object per line, in the session directory, mode 0600. Never a secret
 * value: `credential` only says whether a header was injected.
 */
export const BrokerLogEntry = Schema.Struct({
  time: Schema.String,
  turn: Schema.optional(Schema.Number),
  channel: Schema.Number,
  /**
   * `open`: the CONNECT decision; `request`: one HTTP request on a credential host; `close`:
   * totals; `suppressed`: `count` lines that were not written (repeated denials over the rate
   * limit, `reason: "rate-limited"`, or lines over the writer's queue bound, `"queue-full"`)
   */
  event: Schema.Literal("open", "request", "close", "suppressed"),
  host: Schema.String,
  port: Schema.Number,
  decision: Schema.Literal("allow", "deny"),
  reason: Schema.optional(Schema.String),
  /** the address actually dialled */
  address: Schema.optional(Schema.String),
  mode: Schema.optional(Schema.Literal("passthrough", "terminate", "local-http")),
  /** `request`: the credential header was sent upstream; `close`: on at least one request */
  credential: Schema.Boolean,
  method: Schema.optional(Schema.String),
  status: Schema.optional(Schema.Number),
  bytesUp: Schema.optional(Schema.Number),
  bytesDown: Schema.optional(Schema.Number),
  durationMs: Schema.optional(Schema.Number),
  /** `request`: headers the guest sent with the placeholder in them, dropped (names only) */
  droppedHeaders: Schema.optional(Schema.Array(Schema.String)),
  /** `request`: the request's path, without its query (cut, the guest's text: escaped on display) */
  path: Schema.optional(Schema.String),
  /** `request`: how many times a secret in the response was replaced with the placeholder */
  redacted: Schema.optional(Schema.Number),
  /** `suppressed`: how many lines */
  count: Schema.optional(Schema.Number)
})
export type BrokerLogEntry = typeof BrokerLogEntry.Type

const encodeLine = Schema.encodeSync(Schema.parseJson(BrokerLogEntry))
const decodeLine = Schema.decodeUnknownEither(Schema.parseJson(BrokerLogEntry))

export const BROKER_LOG_FILE = SESSION_FILES.brokerLog
/** the previous broker.log after a rotation (one generation is kept) */
export const rotatedLogPath = (path: string) => `${path}.1`

export interface BrokerLogOptions {
  /**
   * lines waiting for the disk (default 4096); past this, a fiber's `write` waits for the batch
   * being written, a callback's `enqueue` is dropped and counted
   */
  readonly maxQueued?: number
  /** broker.log is rotated to broker.log.1 (replacing it) once it reaches this size (default 8 MiB) */
  readonly rotateBytes?: number
  /** string fields are cut to this many characters (default 256) */
  readonly maxFieldChars?: number
  /** identical denials (event, host, port, reason) written per window (default 5) */
  readonly denialsPerKey?: number
  /** denials of any kind written per window (default 100) */
  readonly denialsPerWindow?: number
  /** the rate limit's window (default 10 s) */
  readonly denialWindowMs?: number
}

export interface BrokerLogWriter {
  /**
   * Write one entry; completes once the batch holding it is on disk (at once if the rate limit
   * suppressed it). When the queue is full the caller waits for the batch being written.
   */
  readonly write: (entry: BrokerLogEntry) => Effect.Effect<void>
  /** Queue one entry without waiting (for plain callbacks). */
  readonly enqueue: (entry: BrokerLogEntry) => void
}

const cut = (text: string, max: number) =>
  text.length <= max ? text : `${text.slice(0, max)}…(${text.length} chars)`

/**
 * The writer behind broker.log, scoped. One writer fiber takes every queued line at once and
 * appends them with one write, so each line costs O(1) however many tunnels log at the same time
 * (callers wait on the batch, not on a lock). The queue is bounded: past `maxQueued` lines a fiber
 * waits for the batch being written (back pressure on the tunnel that logs); a line queued from a
 * callback, which cannot wait, is dropped and counted, and the count is written as a `suppressed`
 * line.
 * Denials are rate-limited (they are what a hostile guest can produce at will); string fields
 * are cut; the file is rotated at a size. On scope close every queued line is written.
 */
export const openBrokerLog = (path: string, options: BrokerLogOptions = {}) =>
  Effect.gen(function* () {
    const fs = yield* FileSystem.FileSystem
    const maxQueued = options.maxQueued ?? 4096
    const rotateBytes = options.rotateBytes ?? 8 * 1024 * 1024
    const maxField = options.maxFieldChars ?? 256
    const perKey = options.denialsPerKey ?? 5
    const perWindow = options.denialsPerWindow ?? 100
    const windowMs = options.denialWindowMs ?? 10_000

    const openFile = Effect.gen(function* () {
      const scope = yield* Scope.make()
      const file = yield* fs.open(path, { flag: "a", mode: 0o600 }).pipe(Scope.extend(scope))
      // an existing file keeps its mode on open: make sure it is 0600 whatever it was
      yield* fs.chmod(path, 0o600)
      const size = yield* fs.stat(path).pipe(Effect.map((info) => Number(info.size)))
      return { scope, file, size }
    })
    let current = yield* openFile
    yield* Effect.addFinalizer(() => Scope.close(current.scope, Exit.void))

    const encoder = new TextEncoder()
    let pending: Array<string> = []
    let batchDone = Deferred.unsafeMake<void>(FiberId.none)
    const wake = yield* Effect.makeLatch(false)
    let queueDropped = 0

    // the sync paths (enqueue from callbacks) read the clock unsafely; it is the fiber's Clock all the same
    const clock = yield* Effect.clock
    // denial rate limit: per key and in total, per window
    let windowStart = clock.unsafeCurrentTimeMillis()
    let windowTotal = 0
    let rateSuppressed = 0
    const perKeyCount = new Map<string, number>()

    const summary = (reason: string, count: number): string =>
      encodeLine({
        time: new Date(clock.unsafeCurrentTimeMillis()).toISOString(),
        channel: 0,
        event: "suppressed",
        host: "*",
        port: 0,
        decision: "deny",
        reason,
        credential: false,
        count
      }) + "\n"

    /** lines owed for the rate limit's last window, once it is over (or `force` at the end) */
    const rollWindow = (now: number, force: boolean): Array<string> => {
      if (!force && now - windowStart < windowMs) return []
      const out = rateSuppressed > 0 ? [summary("rate-limited", rateSuppressed)] : []
      windowStart = now
      windowTotal = 0
      rateSuppressed = 0
      perKeyCount.clear()
      return out
    }

    const admit = (entry: BrokerLogEntry): boolean => {
      if (entry.decision !== "deny") return true
      const key = `${entry.event}\u0000${entry.host}\u0000${entry.port}\u0000${entry.reason ?? ""}`
      const seen = perKeyCount.get(key) ?? 0
      if (windowTotal >= perWindow || seen >= perKey) {
        rateSuppressed++
        return false
      }
      windowTotal++
      perKeyCount.set(key, seen + 1)
      return true
    }

    const capped = (entry: BrokerLogEntry): BrokerLogEntry => ({
      ...entry,
      host: cut(entry.host, maxField),
      ...(entry.reason === undefined ? {} : { reason: cut(entry.reason, maxField) }),
      ...(entry.method === undefined ? {} : { method: cut(entry.method, maxField) }),
      ...(entry.path === undefined ? {} : { path: cut(entry.path, maxField) }),
      ...(entry.address === undefined ? {} : { address: cut(entry.address, maxField) })
    })

    type Pushed =
      | { readonly _tag: "queued"; readonly done: Deferred.Deferred<void> }
      | { readonly _tag: "full"; readonly next: Deferred.Deferred<void> }
      | { readonly _tag: "limited" }
    /** queue a line (after the rate limit); when the queue is full, the batch to wait for */
    const push = (entry: BrokerLogEntry, admitted: boolean): Pushed => {
      const owed = rollWindow(clock.unsafeCurrentTimeMillis(), false)
      if (owed.length > 0) pending.push(...owed)
      if (!admitted && !admit(entry)) return { _tag: "limited" }
      if (pending.length >= maxQueued) return { _tag: "full", next: batchDone }
      pending.push(encodeLine(capped(entry)) + "\n")
      wake.unsafeOpen()
      return { _tag: "queued", done: batchDone }
    }

    /** a fiber's line: when the queue is full it waits for the batch being written (back pressure) */
    const write = (entry: BrokerLogEntry, admitted = false): Effect.Effect<void> =>
      Effect.suspend(() => {
        const pushed = push(entry, admitted)
        switch (pushed._tag) {
          case "limited":
            return Effect.void
          case "queued":
            return Deferred.await(pushed.done)
          case "full":
            return Effect.zipRight(Deferred.await(pushed.next), write(entry, true))
        }
      })

    const rotate = Effect.gen(function* () {
      yield* Scope.close(current.scope, Exit.void)
      // a failed rename keeps appending to the same file rather than losing the writer
      yield* fs
        .rename(path, rotatedLogPath(path))
        .pipe(Effect.catchAll((error) => Effect.logWarning("broker.log rotation failed", error)))
      current = yield* openFile
    })

    const writeOut = (lines: Array<string>) =>
      Effect.gen(function* () {
        if (lines.length === 0) return
        const bytes = encoder.encode(lines.join(""))
        yield* current.file.writeAll(bytes)
        current.size += bytes.length
        if (current.size >= rotateBytes) yield* rotate
      }).pipe(Effect.catchAll((error) => Effect.logWarning("broker.log write failed", error)))

    /** take everything queued (and the counts owed) as one batch */
    const takeBatch = () => {
      const lines = pending
      const done = batchDone
      pending = []
      batchDone = Deferred.unsafeMake<void>(FiberId.none)
      if (queueDropped > 0) {
        lines.push(summary("queue-full", queueDropped))
        queueDropped = 0
      }
      return { lines, done }
    }

    const flushOnce = Effect.suspend(() => {
      const { lines, done } = takeBatch()
      return writeOut(lines).pipe(Effect.ensuring(Deferred.succeed(done, undefined)))
    }).pipe(Effect.uninterruptible)

    yield* Effect.addFinalizer(() =>
      Effect.suspend(() => {
        pending.push(...rollWindow(clock.unsafeCurrentTimeMillis(), true))
        return flushOnce
      })
    )
    yield* Effect.forkScoped(
      Effect.forever(Effect.zipRight(Effect.zipRight(wake.await, wake.close), flushOnce))
    )

    return {
      write: (entry) => write(entry),
      // callbacks cannot wait: past the bound their line is dropped and counted
      enqueue: (entry) => {
        if (push(entry, false)._tag === "full") queueDropped++
      }
    } satisfies BrokerLogWriter
  })

export interface BrokerLogRead {
  readonly entries: ReadonlyArray<BrokerLogEntry>
  /** line numbers (1-based) that did not decode; left as they are */
  readonly badLines: ReadonlyArray<number>
}

/** Read and decode a session's broker.log (after its rotated part); a missing file is an empty log. */
export const readBrokerLog = Effect.fn("BrokerLog.read")(function* (path: string) {
  const fs = yield* FileSystem.FileSystem
  const entries: Array<BrokerLogEntry> = []
  const badLines: Array<number> = []
  let offset = 0
  for (const file of [rotatedLogPath(path), path]) {
    if (!(yield* fs.exists(file))) continue
    const lines = (yield* fs.readFileString(file)).split("\n")
    lines.forEach((line, index) => {
      if (line.trim() === "") return
      const decoded = decodeLine(line)
      if (decoded._tag === "Right") entries.push(decoded.right)
      else badLines.push(offset + index + 1)
    })
    offset += lines.length - 1
  }
  return { entries, badLines } satisfies BrokerLogRead
})

/**
 * broker.log (after its rotated part) as printable lines, read as a stream: one formatted line
 * per entry, `(unreadable line N)` for a line that does not decode. Nothing is held whole.
 */
export const streamBrokerLog = (path: string): Stream.Stream<string, PlatformError, FileSystem.FileSystem> =>
  Stream.unwrap(
    Effect.gen(function* () {
      const fs = yield* FileSystem.FileSystem
      let lineNo = 0
      // a part that is not there (never rotated, or mid-rotation) is empty; other errors fail
      const lines = (file: string) =>
        fs.stream(file).pipe(
          Stream.decodeText(),
          Stream.splitLines,
          Stream.catchAll((error) =>
            error._tag === "SystemError" && error.reason === "NotFound" ? Stream.empty : Stream.fail(error)
          )
        )
      return Stream.concat(lines(rotatedLogPath(path)), lines(path)).pipe(
        Stream.filterMap((line) => {
          lineNo++
          if (line.trim() === "") return Option.none()
          const decoded = decodeLine(line)
          return Option.some(
            decoded._tag === "Right" ? formatBrokerLogEntry(decoded.right) : `(unreadable line ${lineNo})`
          )
        })
      )
    })
  )

/** One human line per entry, for `abox logs --broker`; guest-chosen text is escaped. */
export const formatBrokerLogEntry = (e: BrokerLogEntry): string => {
  const text = (s: string) => escapeControl(s)
  if (e.event === "suppressed")
    return [e.time, `${e.count ?? 0} line(s) not written (${text(e.reason ?? "")})`].join("  ")
  const parts = [
    e.time,
    e.turn === undefined ? "turn -" : `turn ${e.turn}`,
    `#${e.channel}`,
    e.event.padEnd(7),
    e.decision.toUpperCase().padEnd(5),
    `${text(e.host)}:${e.port}`
  ]
  if (e.reason !== undefined) parts.push(`(${text(e.reason)})`)
  if (e.mode !== undefined) parts.push(e.mode)
  if (e.address !== undefined) parts.push(`via ${text(e.address)}`)
  if (e.method !== undefined) parts.push(text(e.method))
  if (e.path !== undefined) parts.push(text(e.path))
  if (e.status !== undefined) parts.push(String(e.status))
  if (e.credential)
    parts.push(e.event === "close" ? "credential injected on requests" : "credential injected")
  if (e.droppedHeaders !== undefined && e.droppedHeaders.length > 0)
    parts.push(`placeholder dropped from ${e.droppedHeaders.map(text).join(", ")}`)
  if (e.redacted !== undefined && e.redacted > 0)
    parts.push(`secret replaced in the response (${e.redacted}x)`)
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
