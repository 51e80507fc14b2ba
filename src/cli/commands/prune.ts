import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Console from "effect/Console"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import { prune as pruneSessions } from "../../programs/remove.js"
import { edge, printJson, UsageError } from "../render.js"
import { json } from "./list.js"
import { confirmRemovals, describeRemoval, removalJson, yes } from "./rm.js"

const UNITS: Record<string, number> = { m: 60_000, h: 3_600_000, d: 86_400_000, w: 604_800_000 }

/** `30m`, `12h`, `7d`, `2w` */
export const parseAge = (text: string): Option.Option<Duration.Duration> => {
  const match = /^(\d+)([mhdw])$/.exec(text.trim())
  return match === null ? Option.none() : Option.some(Duration.millis(Number(match[1]) * UNITS[match[2]!]!))
}

export const prune = Command.make(
  "prune",
  {
    olderThan: Options.text("older-than").pipe(
      Options.optional,
      Options.withDescription(
        "only sessions last used (closed, else created) longer ago than this: 30m, 12h, 7d, 2w"
      )
    ),
    dryRun: Options.boolean("dry-run").pipe(
      Options.withDescription("say what would be removed, remove nothing")
    ),
    yes,
    json
  },
  (args) =>
    edge({ json: args.json })(
      Effect.gen(function* () {
        let olderThan: Duration.Duration | undefined
        if (Option.isSome(args.olderThan)) {
          const text = args.olderThan.value
          const age = parseAge(text)
          if (Option.isNone(age)) {
            return yield* new UsageError({
              message: `--older-than ${JSON.stringify(text)}: give a number and a unit (m, h, d, w), e.g. 7d`
            })
          }
          olderThan = age.value
        }
        const result = yield* pruneSessions({ olderThan, dryRun: args.dryRun }, (removals) =>
          confirmRemovals(removals, args.yes)
        )
        if (args.json) {
          return yield* printJson({
            removed: result.removed.map(removalJson),
            dryRun: result.dryRun,
            skipped: result.skipped
          })
        }
        const verb = result.dryRun ? "would remove" : "removed"
        const lines = [
          ...result.removed.map((r) => `${verb} ${describeRemoval(r)}`),
          ...result.skipped.map((s) => `kept ${s.id}: ${s.reason}`)
        ]
        yield* Console.log(lines.length > 0 ? lines.join("\n") : "nothing to prune")
      })
    )
).pipe(
  Command.withDescription(
    "remove stopped sessions (all, or those last used before --older-than); asks first; running sessions are kept. Example: abox prune --older-than 7d --dry-run"
  )
)
