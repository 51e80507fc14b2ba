// Runs the whole test suite (vitest) and ends with one plain summary line,
// "N passed, N failed, N skipped", that any CI log reader understands; exits with vitest's code.
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"

const report = path.join(".build", "vitest-report.json")
fs.mkdirSync(path.dirname(report), { recursive: true })
fs.rmSync(report, { force: true })
const vitest = spawnSync(
  process.execPath,
  [
    "node_modules/vitest/vitest.mjs",
    "run",
    "--reporter=default",
    "--reporter=json",
    `--outputFile=${report}`,
    ...process.argv.slice(2)
  ],
  { stdio: "inherit" }
)
let summary = "0 passed, 1 failed (no test report was written)"
if (fs.existsSync(report)) {
  const r = JSON.parse(fs.readFileSync(report, "utf8"))
  const skipped = (r.numPendingTests ?? 0) + (r.numTodoTests ?? 0)
  summary = `${r.numPassedTests} passed, ${r.numFailedTests} failed, ${skipped} skipped`
}
console.log(`\ntests: ${summary}`)
process.exit(vitest.status ?? 1)
