import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
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

export const list = Command.make("list", { json }, (args) =>
  edge({ json: args.json })(
    Effect.gen(function* () {
      const store = yield* SessionStore
      const [rows, names] = yield* Effect.all([store.list(), store.listNames()], { concurrency: 2 })
      const by = namesBySession(names)
      if (args.json) {
        yield* printJson({ sessions: rows.map((row) => rowJson(row, by.get(row.id) ?? [])) })
      } else if (rows.length === 0) {
        yield* Console.log("no sessions")
      } else {
        yield* Console.log(rows.map((row) => rowText(row, by.get(row.id) ?? [])).join("\n"))
      }
    })
  )
).pipe(Command.withDescription("list sessions (current and legacy home); corrupt ones with the reason"))
