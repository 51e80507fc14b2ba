import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as fs from "node:fs"
import { formatBytes } from "../../lib/diskUsage.js"
import { controlSocketPath } from "../../lib/socketPath.js"
import { listSessions, type ListedSession } from "../../programs/list.js"
import type { StatusInfo as StatusReply } from "../../services/ControlRpc.js"
import type { NameBinding } from "../../services/SessionStore.js"
import { edge, errorJson, printJson } from "../render.js"
import { escapeControl } from "../../lib/text.js"

export const json = Options.boolean("json").pipe(Options.withDescription("print JSON on stdout"))

export const namesBySession = (names: ReadonlyArray<NameBinding>): Map<string, Array<string>> => {
  const by = new Map<string, Array<string>>()
  for (const b of names) by.set(b.sessionId, [...(by.get(b.sessionId) ?? []), b.name])
  return by
}

const rowJson = (row: ListedSession) => {
  const common = {
    id: row.id,
    legacy: row.legacy,
    dir: row.dir,
    names: row.names,
    running: row.status === "running",
    bytes: row.bytes,
    sharedBytes: row.sharedBytes
  }
  return row._tag === "Ok"
    ? { ...common, status: "ok", meta: row.meta }
    : { ...common, status: "corrupt", ...errorJson(row.error) }
}

const HEADER = ["ID", "STATUS", "SIZE", "SHARED", "LAST CLOSE", "CREATED", "MODEL", "SOURCE"]

/** the image bytes a session's overlay backs onto, counted once per image however many use it */
const sharedCell = (row: ListedSession): string => (row.sharedBytes > 0 ? formatBytes(row.sharedBytes) : "-")

const rowCells = (row: ListedSession): ReadonlyArray<string> => {
  const origin = row._tag === "Ok" ? row.meta.fork : undefined
  const tags = [
    row.legacy ? "legacy" : "",
    row.names.join(","),
    origin === undefined ? "" : `fork of ${origin.parentName ?? origin.parent}`
  ].filter((s) => s !== "")
  const suffix = tags.length > 0 ? `  [${tags.join("; ")}]` : ""
  const status = row.status === "running" ? "RUNNING" : "STOPPED"
  if (row._tag !== "Ok")
    return [row.id, status, formatBytes(row.bytes), "-", `CORRUPT: ${row.error.message}${suffix}`]
  const last = row.status === "running" ? "-" : (row.meta.lastClose?.how ?? "never")
  return [
    row.id,
    status,
    formatBytes(row.bytes),
    sharedCell(row),
    last,
    row.meta.created,
    row.meta.model,
    `${row.meta.source}${suffix}`
  ]
}

/**
 * columns padded to their widest cell; the last column as it is. Every cell has its control
 * characters escaped (a source path or name with ESC or a newline is shown, not obeyed).
 */
const table = (cells: ReadonlyArray<ReadonlyArray<string>>): string => {
  const rows = cells.map((row) => row.map((cell) => escapeControl(cell)))
  const widths: Array<number> = []
  for (const row of rows) {
    row.forEach((cell, i) => {
      if (i < row.length - 1) widths[i] = Math.max(widths[i] ?? 0, cell.length)
    })
  }
  return rows
    .map((row) => row.map((cell, i) => (i < row.length - 1 ? cell.padEnd(widths[i] ?? 0) : cell)).join("  "))
    .join("\n")
}

/**
 * The status of a session's supervisor, None when nobody serves it. Without a control socket
 * there is nobody to ask (what `statusIfRunning` would find at once), and the control client
 * is not even loaded: most sessions are not detached, and `list` stays light (its start-up
 * is a feature, docs/performance.md). The sockets are looked for in one synchronous pass.
 */
const supervisorStatuses = (rows: ReadonlyArray<ListedSession>) =>
  Effect.sync(() =>
    rows.map((row) => row._tag === "Ok" && !row.legacy && fs.existsSync(controlSocketPath(row.dir)))
  ).pipe(
    Effect.flatMap((served) =>
      served.some((s) => s)
        ? Effect.flatMap(
            Effect.promise(() => import("../../programs/detached.js")),
            (detached) =>
              Effect.forEach(
                rows.filter((_, i) => served[i]),
                (row) => Effect.map(detached.statusIfRunning(row.id), (status) => [row, status] as const),
                { concurrency: 8 }
              ).pipe(
                Effect.map((found) => {
                  const of = new Map(found)
                  return rows.map((row) => of.get(row) ?? Option.none<StatusReply>())
                })
              )
          )
        : Effect.succeed(rows.map(() => Option.none<StatusReply>()))
    )
  )

/** a detached session's supervisor as `list` shows it (null: nobody serves the session) */
const supervisorJson = (status: StatusReply, now: number) => ({
  pid: status.pid,
  started: status.started,
  uptimeSeconds: Math.max(0, Math.round((now - Date.parse(status.started)) / 1000)),
  clients: status.clients - 1,
  turn: status.turn
})

const uptime = (seconds: number) =>
  seconds < 60
    ? `${seconds}s`
    : seconds < 3600
      ? `${Math.floor(seconds / 60)}m${String(seconds % 60).padStart(2, "0")}s`
      : `${Math.floor(seconds / 3600)}h${String(Math.floor((seconds % 3600) / 60)).padStart(2, "0")}m`

const supervisorText = (s: ReturnType<typeof supervisorJson>) =>
  `  running: pid ${s.pid}, up ${uptime(s.uptimeSeconds)}, ${s.clients} client${s.clients === 1 ? "" : "s"}${s.turn !== null ? `, turn ${s.turn} running` : ""}`

export const list = Command.make("list", { json }, (args) =>
  edge({ json: args.json })(
    Effect.gen(function* () {
      const rows = yield* listSessions()
      // detached sessions: ask each session's control socket (no socket: not running, at once)
      const supervisors = yield* supervisorStatuses(rows)
      const now = Date.now()
      const supervisorOf = (i: number) =>
        Option.getOrNull(Option.map(supervisors[i] ?? Option.none(), (s) => supervisorJson(s, now)))
      if (args.json) {
        yield* printJson({
          sessions: rows.map((row, i) => ({ ...rowJson(row), supervisor: supervisorOf(i) }))
        })
      } else if (rows.length === 0) {
        yield* Console.log("no sessions")
      } else {
        const cells = rows.map((row, i) => {
          const supervisor = supervisorOf(i)
          const row_ = rowCells(row)
          return supervisor === null
            ? row_
            : [...row_.slice(0, -1), row_.at(-1)! + supervisorText(supervisor)]
        })
        yield* Console.log(table([HEADER, ...cells]))
      }
    })
  )
).pipe(
  Command.withDescription(
    "list sessions with status (RUNNING/STOPPED), disk usage and last close; corrupt ones with the reason. Example: abox list --json"
  )
)
