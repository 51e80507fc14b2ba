import { beforeAll, describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { scrubConfigDisk, scrubGuestConfigJson } from "../src/layers/SecretScrubberLive.js"
import { dirtySessionFiles, writeSession } from "./support/scrubFixtures.js"
import { bundleScript, killAll, startScript, type Worker } from "./support/scriptWorker.js"

const SESSIONS = 300
let WORKER = ""

beforeAll(async () => {
  WORKER = await Effect.runPromise(bundleScript("test/support/scrubWorker.ts"))
}, 60_000)

/** a home with SESSIONS dirty sessions; per file: the original bytes and the fully scrubbed ones */
const makeDirtyHome = Effect.acquireRelease(
  Effect.sync(() => {
    const root = fs.mkdtempSync(path.join(os.tmpdir(), "abox-scrub-crash-"))
    const sessions = path.join(root, "abox", "sessions")
    const expected = new Map<string, { readonly before: Buffer; readonly after: Buffer }>()
    for (let i = 0; i < SESSIONS; i++) {
      const id = `s${String(i).padStart(4, "0")}`
      const files = dirtySessionFiles(id, `sk-ant-api03-${id}${"x".repeat(40)}`)
      const dir = writeSession(sessions, id, files)
      expected.set(path.join(dir, "config.raw"), {
        before: files.configRaw,
        after: Buffer.from(scrubConfigDisk(files.configRaw).bytes)
      })
      expected.set(path.join(dir, "guest-config.json"), {
        before: files.guestConfig,
        after: Buffer.from(scrubGuestConfigJson(files.guestConfig).bytes)
      })
    }
    return { root, home: path.join(root, "abox"), userHome: path.join(root, "user"), sessions, expected }
  }),
  ({ root }) => Effect.sync(() => fs.rmSync(root, { recursive: true, force: true }))
)

describe("SecretScrubber crash safety", () => {
  it.scopedLive(
    "SIGKILL mid-scrub leaves every file either byte-identical to the original or fully scrubbed",
    () =>
      Effect.gen(function* () {
        const workers: Array<Worker> = []
        yield* Effect.addFinalizer(() => killAll(workers))
        const tally = { partialRuns: 0, old: 0, scrubbed: 0 }
        // kill after growing delays until one run is caught halfway; every run must hold the invariant
        for (const delayMs of [2, 10, 25, 50, 100, 200, 400]) {
          const outcome = yield* Effect.scoped(
            Effect.gen(function* () {
              const { home, userHome, sessions, expected } = yield* makeDirtyHome
              const worker = startScript(WORKER, [home, userHome])
              workers.push(worker)
              expect(yield* worker.line).toBe("START")
              yield* Effect.sleep(delayMs)
              worker.child.kill("SIGKILL")
              yield* worker.exited
              let old = 0
              let scrubbed = 0
              for (const [file, { before, after }] of expected) {
                const now = fs.readFileSync(file)
                if (now.equals(before)) old++
                else if (now.equals(after)) scrubbed++
                else expect.fail(`${file} is neither the original nor the scrubbed file`)
              }
              // no session or file removed
              expect(fs.readdirSync(sessions)).toHaveLength(SESSIONS)
              return { old, scrubbed }
            })
          )
          tally.old += outcome.old
          tally.scrubbed += outcome.scrubbed
          if (outcome.old > 0 && outcome.scrubbed > 0) {
            tally.partialRuns++
            break
          }
        }
        console.log(`scrub crash test: ${JSON.stringify(tally)}`)
        expect(tally.partialRuns).toBe(1)
      }),
    120_000
  )
})
