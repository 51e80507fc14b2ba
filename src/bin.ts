import * as Effect from "effect/Effect"
import { cli } from "./cli/main.js"
import { exitCodeOf, parsedAtTheEdge, reportUnexpected } from "./cli/render.js"
import { runMain } from "./cli/runMain.js"
import { MainLive } from "./layers/Main.js"

cli(process.argv).pipe(
  parsedAtTheEdge(process.argv),
  Effect.provide(MainLive),
  runMain({
    // errors are rendered by each command's edge (src/cli/render.ts); only the unexpected is printed here
    disableErrorReporting: true,
    teardown: (exit, onExit) => {
      const unexpected = reportUnexpected(exit)
      if (unexpected !== undefined) process.stderr.write(`${unexpected}\n`)
      onExit(exitCodeOf(exit))
    }
  })
)
