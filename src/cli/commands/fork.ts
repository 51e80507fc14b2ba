import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import { fork } from "../../programs/fork.js"
import { edge, printJson } from "../render.js"
import { json } from "./list.js"
import { sessionRef } from "./show.js"
import { escapeControl } from "../../lib/text.js"

export const forkCommand = Command.make(
  "fork",
  {
    ref: sessionRef,
    name: Options.text("name").pipe(
      Options.withDescription("the new session's name (refused if taken; characters outside [A-Za-z0-9_-] become _ in its file name)"),
      Options.optional
    ),
    json
  },
  (args) =>
    edge({ json: args.json })(
      Effect.gen(function* () {
        const child = yield* fork(args.ref, { name: Option.getOrUndefined(args.name) })
        if (args.json) return yield* printJson({ session: child })
        const ref = child.name ?? child.id
        yield* Console.log(child.id)
        yield* Console.error(
          escapeControl(
            `abox: forked ${args.ref} (${child.fork?.from ?? "stopped"}) into ${ref}; abox start ${ref} ${child.fork?.from === "stopped" ? "boots it" : "restores its memory"}`
          )
        )
      })
    )
).pipe(
  Command.withDescription(
    "make a new session from another (running detached, suspended or stopped) in about constant time: both go on from here independently over a shared frozen copy of its disks; the fork gets its memory (processes and all), a new id, a new broker CA and fresh entropy when it starts. Example: abox fork proj --name proj-try"
  )
)
