/**
 * A real process running the scrubber over a home, for the crash test in test/scrub.crash.test.ts:
 *
 *   node scrubWorker.mjs <home> <userHome>
 *
 * prints `START` before the scrub and `DONE <ms> <findings>` after it.
 */
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { SecretScrubberLive } from "../../src/layers/SecretScrubberLive.js"
import { aboxPathsAt } from "../../src/services/AboxPaths.js"
import { SecretScrubber } from "../../src/services/SecretScrubber.js"

const [home, userHome] = process.argv.slice(2)
if (home === undefined || userHome === undefined) {
  process.stderr.write("usage: scrubWorker <home> <userHome>\n")
  process.exit(64)
}

const program = Effect.gen(function* () {
  const scrubber = yield* SecretScrubber
  yield* Effect.sync(() => process.stdout.write("START\n"))
  const started = performance.now()
  const report = yield* scrubber.scrub({ dryRun: false })
  const ms = (performance.now() - started).toFixed(1)
  yield* Effect.sync(() =>
    process.stdout.write(`DONE ${ms} ${report.findings.length} ${report.problems.length}\n`)
  )
})

await Effect.runPromise(
  program.pipe(
    Effect.provide(
      SecretScrubberLive.pipe(Layer.provide(aboxPathsAt(home, userHome)), Layer.provide(NodeFileSystem.layer))
    )
  )
)
