import * as Effect from "effect/Effect"
import { loadCli } from "./cli/dispatch.js"
import { exitCodeFor } from "./cli/exitCodes.js"
import {
  CliExit,
  exitCodeOf,
  parsedAtTheEdge,
  renderError,
  reportUnexpected,
  wantsJson
} from "./cli/render.js"
import { runMain } from "./cli/runMain.js"

// only what this command line needs is loaded (src/cli/dispatch.ts): start-up is a feature
Effect.promise(() => loadCli(process.argv)).pipe(
  Effect.flatMap((cli) => cli(process.argv)),
  parsedAtTheEdge(process.argv),
  // the environment is read as the services are made, before any command's edge
  Effect.catchTag("ConfigInvalid", (error) =>
    renderError(error, wantsJson(process.argv)).pipe(
      Effect.zipRight(Effect.fail(new CliExit({ code: exitCodeFor(error._tag), tag: error._tag })))
    )
  ),
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
