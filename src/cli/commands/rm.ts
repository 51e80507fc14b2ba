import * as Args from "@effect/cli/Args"
import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Prompt from "@effect/cli/Prompt"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import { formatBytes } from "../../lib/diskUsage.js"
import { remove, type Removal } from "../../programs/remove.js"
import { Cancelled, ConfirmationRequired, edge, notAnOption, printJson } from "../render.js"
import { json } from "./list.js"
import { escapeControl } from "../../lib/text.js"

export const yes = Options.boolean("yes").pipe(Options.withAlias("y"), Options.withDescription("do not ask"))

/** ask on a terminal; without one, refuse unless --yes */
export const confirm = (question: string, assumeYes: boolean) =>
  Effect.gen(function* () {
    if (assumeYes) return
    // the one place the CLI needs to know whether a human is there to answer
    if (process.stdin.isTTY !== true) {
      return yield* new ConfirmationRequired({
        message: "refusing to delete without --yes: stdin is not a terminal, so nobody can be asked"
      })
    }
    const answer = yield* Prompt.run(Prompt.confirm({ message: question, initial: false })).pipe(
      Effect.catchTag("QuitException", () => Effect.succeed(false))
    )
    if (!answer) return yield* new Cancelled({ message: "nothing was removed" })
  })

/** one line per removal: what is lost with it (names and paths with their control characters escaped) */
export const describeRemoval = (removal: Removal): string => escapeControl(removalText(removal))

const removalText = (removal: Removal): string => {
  if (removal._tag === "Name") return `the name ${removal.name} (its session ${removal.sessionId} is gone)`
  const names = removal.names.length > 0 ? ` [${removal.names.join(", ")}]` : ""
  const meta = removal.meta
  const origin =
    meta === undefined
      ? "session.json unreadable"
      : `source ${meta.source}, created ${meta.created}${meta.lastClose ? `, last closed ${meta.lastClose.at}` : ""}`
  const forks =
    removal.forks.length > 0 ? `; its forks ${removal.forks.join(", ")} are made independent of it first` : ""
  return `session ${removal.id}${names} (${origin}): ${formatBytes(removal.bytes)} — its guest disk with every change made in it, the repository copy, its logs${forks}`
}

/** the y/N prompt of rm and prune: everything that will be lost, then the question */
export const confirmRemovals = (removals: ReadonlyArray<Removal>, assumeYes: boolean) =>
  Effect.gen(function* () {
    if (assumeYes || removals.length === 0) return
    if (process.stdin.isTTY === true) {
      yield* Console.error(`This deletes:\n${removals.map((r) => `  ${describeRemoval(r)}`).join("\n")}`)
    }
    yield* confirm(
      removals.length === 1
        ? "Delete it? This cannot be undone."
        : `Delete these ${removals.length}? This cannot be undone.`,
      assumeYes
    )
  })

export const removalJson = (removal: Removal) =>
  removal._tag === "Name"
    ? { name: removal.name, sessionId: null }
    : { sessionId: removal.id, names: removal.names, bytes: removal.bytes }

export const rm = Command.make(
  "rm",
  {
    refs: notAnOption(Args.text({ name: "id|name" })).pipe(
      Args.withDescription(
        "session ids or names (all or nothing: a running session stops the whole removal)"
      ),
      Args.atLeast(1)
    ),
    yes,
    force: Options.boolean("force").pipe(
      Options.withDescription(
        "a session that has forks (they read its frozen disk layers): make them independent first (their disks rebased off it), then remove it"
      )
    ),
    json
  },
  (args) =>
    edge({ json: args.json })(
      Effect.gen(function* () {
        const removed = yield* remove(args.refs, (removals) => confirmRemovals(removals, args.yes), {
          force: args.force
        })
        if (args.json) return yield* printJson({ removed: removed.map(removalJson) })
        for (const r of removed) {
          yield* Console.log(escapeControl(r._tag === "Name" ? `removed name ${r.name}` : `removed ${r.id}`))
        }
      })
    )
).pipe(
  Command.withDescription(
    "delete sessions (their directories and names) or dangling names; asks first (--yes when not on a terminal); refuses a running session. Example: abox rm proj 01jq…"
  )
)
