import * as Args from "@effect/cli/Args"
import * as Command from "@effect/cli/Command"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import { SessionStore } from "../../services/SessionStore.js"
import { edge, notAnOption, printJson } from "../render.js"
import { json } from "./list.js"
import { escapeControl } from "../../lib/text.js"

export const name = Command.make(
  "name",
  {
    ref: notAnOption(Args.text({ name: "id" })).pipe(
      Args.withDescription("the session (an id, or a name it already has)")
    ),
    name: notAnOption(Args.text({ name: "name" })).pipe(
      Args.withDescription("the new name; characters outside [A-Za-z0-9_-] become _ in its file name")
    ),
    json
  },
  (args) =>
    edge({ json: args.json })(
      Effect.gen(function* () {
        const store = yield* SessionStore
        const id = yield* store.resolve(args.ref)
        const binding = yield* store.bindName(args.name, id)
        if (args.json) yield* printJson({ name: binding })
        else yield* Console.log(escapeControl(`${binding.name} → ${binding.sessionId}`))
      })
    )
).pipe(
  Command.withDescription(
    "give a session a name, usable wherever an id is (a name cannot look like a session id). Example: abox name 01jq… api-work"
  )
)
