import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import { statusIfRunning } from "../../programs/detached.js"
import type { StatusReply } from "../../protocol/Control.js"
import { SessionStore, type NameBinding, type SessionListing } from "../../services/SessionStore.js"
import { edge, errorJson, printJson } from "../render.js"

export const json = Options.boolean("json").pipe(Options.withDescription("print JSON on stdout"))

export const namesBySession = (names: ReadonlyArray<NameBinding>): Map<string, Array<string>> => {
  const by = new Map<string, Array<string>>()
  for (const b of names) by.set(b.sessionId, [...(by.get(b.sessionId) ?? []), b.name])
  return by
}

const rowJson = (row: SessionListing, names: ReadonlyArray<string>) =>
  row._tag === "Ok"
    ? { id: row.id, status: "ok", legacy: row.legacy, dir: row.dir, names, meta: row.meta }
    : { id: row.id, status: "corrupt", legacy: row.legacy, dir: row.dir, names, ...errorJson(row.error) }

const rowText = (row: SessionListing, names: ReadonlyArray<string>): string => {
  const tags = [row.legacy ? "legacy" : "", names.length > 0 ? names.join(",") : ""].filter((s) => s !== "")
  const suffix = tags.length > 0 ? `  [${tags.join("; ")}]` : ""
  return row._tag === "Ok"
    ? `${row.id}  ${row.meta.created}  ${row.meta.model}  ${row.meta.source}${suffix}`
    : `${row.id}  CORRUPT: ${row.error.message}${suffix}`
}

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
      const store = yield* SessionStore
      const [rows, names] = yield* Effect.all([store.list(), store.listNames()], { concurrency: 2 })
      const by = namesBySession(names)
      // detached sessions: ask each session's control socket (no socket: not running, at once)
      const supervisors = yield* Effect.forEach(
        rows,
        (row) =>
          row._tag === "Ok" && !row.legacy ? statusIfRunning(row.id) : Effect.succeed(Option.none<StatusReply>()),
        { concurrency: 8 }
      )
      const now = Date.now()
      const supervisorOf = (i: number) =>
        Option.getOrNull(Option.map(supervisors[i] ?? Option.none(), (s) => supervisorJson(s, now)))
      if (args.json) {
        yield* printJson({
          sessions: rows.map((row, i) => ({ ...rowJson(row, by.get(row.id) ?? []), supervisor: supervisorOf(i) }))
        })
      } else if (rows.length === 0) {
        yield* Console.log("no sessions")
      } else {
        yield* Console.log(
          rows
            .map((row, i) => {
              const supervisor = supervisorOf(i)
              return rowText(row, by.get(row.id) ?? []) + (supervisor !== null ? supervisorText(supervisor) : "")
            })
            .join("\n")
        )
      }
    })
  )
).pipe(Command.withDescription("list sessions (current and legacy home); corrupt ones with the reason"))
