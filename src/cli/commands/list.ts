import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import { formatBytes } from "../../lib/diskUsage.js"
import { listSessions, type ListedSession } from "../../programs/list.js"
import type { NameBinding } from "../../services/SessionStore.js"
import { edge, errorJson, printJson } from "../render.js"

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
    bytes: row.bytes
  }
  return row._tag === "Ok"
    ? { ...common, status: "ok", meta: row.meta }
    : { ...common, status: "corrupt", ...errorJson(row.error) }
}

const HEADER = ["ID", "STATUS", "SIZE", "LAST CLOSE", "CREATED", "MODEL", "SOURCE"]

const rowCells = (row: ListedSession): ReadonlyArray<string> => {
  const tags = [row.legacy ? "legacy" : "", row.names.join(",")].filter((s) => s !== "")
  const suffix = tags.length > 0 ? `  [${tags.join("; ")}]` : ""
  const status = row.status === "running" ? "RUNNING" : "STOPPED"
  if (row._tag !== "Ok")
    return [row.id, status, formatBytes(row.bytes), `CORRUPT: ${row.error.message}${suffix}`]
  const last = row.status === "running" ? "-" : (row.meta.lastClose?.how ?? "never")
  return [
    row.id,
    status,
    formatBytes(row.bytes),
    last,
    row.meta.created,
    row.meta.model,
    `${row.meta.source}${suffix}`
  ]
}

/** columns padded to their widest cell; the last column as it is */
const table = (rows: ReadonlyArray<ReadonlyArray<string>>): string => {
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

export const list = Command.make("list", { json }, (args) =>
  edge({ json: args.json })(
    Effect.gen(function* () {
      const rows = yield* listSessions()
      if (args.json) {
        yield* printJson({ sessions: rows.map((row) => rowJson(row)) })
      } else if (rows.length === 0) {
        yield* Console.log("no sessions")
      } else {
        yield* Console.log(table([HEADER, ...rows.map((row) => rowCells(row))]))
      }
    })
  )
).pipe(
  Command.withDescription(
    "list sessions with status (RUNNING/STOPPED), disk usage and last close; corrupt ones with the reason. Example: abox list --json"
  )
)
