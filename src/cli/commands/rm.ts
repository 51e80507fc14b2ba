import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Prompt from "@effect/cli/Prompt"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import { SessionStore } from "../../services/SessionStore.js"
import { Cancelled, ConfirmationRequired, edge, printJson } from "../render.js"
import { json } from "./list.js"
import { sessionRef } from "./show.js"

const yes = Options.boolean("yes").pipe(Options.withAlias("y"), Options.withDescription("do not ask"))

/** ask on a terminal; without one, refuse unless --yes */
const confirm = (question: string, assumeYes: boolean) =>
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

export const rm = Command.make("rm", { ref: sessionRef, yes, json }, (args) =>
  edge({ json: args.json })(
    Effect.gen(function* () {
      const store = yield* SessionStore
      const found = yield* store.resolve(args.ref).pipe(Effect.either)
      if (found._tag === "Left") {
        // a dangling name (its session is gone) can still be removed
        const error = found.left
        const binding = yield* store.lookupName(args.ref).pipe(Effect.option)
        if (error._tag !== "SessionNotFound" || Option.isNone(binding)) return yield* error
        yield* confirm(
          `Remove the name "${args.ref}" (its session ${binding.value.sessionId} is gone)?`,
          args.yes
        )
        yield* store.unbindName(args.ref)
        if (args.json) return yield* printJson({ removed: { name: args.ref, sessionId: null } })
        return yield* Console.log(`removed name ${args.ref}`)
      }
      const id = found.right
      const meta = yield* store.get(id).pipe(Effect.option)
      const what = Option.match(meta, {
        onNone: () => `session ${id}`,
        onSome: (m) => `session ${id} (source ${m.source}, created ${m.created})`
      })
      yield* confirm(`Delete ${what} and its disk? This cannot be undone.`, args.yes)
      yield* store.remove(id)
      if (args.json) yield* printJson({ removed: { sessionId: id } })
      else yield* Console.log(`removed ${id}`)
    })
  )
).pipe(
  Command.withDescription(
    "delete a session directory and its names (asks first; --yes when not on a terminal)"
  )
)
