// The Effect API: the open program itself, scoped (Close is the scope's end), typed errors.
//   node examples/sdk/effect.mjs [repo-dir]
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import { Abox } from "abox"

const source = process.argv[2] ?? new URL("../hello", import.meta.url).pathname

const program = Effect.gen(function* () {
  const session = yield* Abox.open({ source })
  const events = yield* Stream.runCollect(session.turn("ls"))
  return [...events].flatMap((e) => (e._tag === "Event" && e.event.kind === "stdout" ? [e.event.data] : [])).join("")
}).pipe(
  Effect.scoped,
  Effect.catchTag("SessionBusy", (e) => Effect.succeed(`busy: ${e.message}`)),
  Effect.provide(Abox.layer)
)

process.stdout.write(await Effect.runPromise(program))
