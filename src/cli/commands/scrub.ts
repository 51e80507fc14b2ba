import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import { scanMemoryStates } from "../../programs/scrubStates.js"
import { SecretScrubber, type ScrubReport } from "../../services/SecretScrubber.js"
import { edge, printJson } from "../render.js"
import { json } from "./list.js"
import { SESSION_FILES } from "../../domain/sessionLayout.js"

const dryRun = Options.boolean("dry-run").pipe(
  Options.withDescription("report what would be removed; change nothing")
)

type Report = ScrubReport & { readonly memoryStatesScanned: number }

const isMemoryState = (file: string) => file.endsWith(`/${SESSION_FILES.memoryState}`)

const reportText = (report: Report): string => {
  const lines = [
    `${report.dryRun ? "dry run: " : ""}scanned ${report.sessionsScanned} session(s), ${report.filesScanned} file(s), ${report.memoryStatesScanned} memory state(s)`
  ]
  for (const f of report.findings) {
    // a memory state is the guest's RAM: reported, never rewritten (src/programs/scrubStates.ts)
    const verb = isMemoryState(f.path)
      ? "found (left as it is: it is the guest's memory)"
      : f.changed
        ? "removed"
        : report.dryRun
          ? "would remove"
          : "found"
    lines.push(
      `${f.path}: ${verb} ${f.count} secret(s) (${f.kinds.join(", ")})${f.legacy ? " [legacy]" : ""}`
    )
  }
  for (const p of report.problems) lines.push(`${p.path}: could not check: ${p.reason}`)
  if (report.findings.length === 0) lines.push("no plaintext secrets found")
  return lines.join("\n")
}

export const scrub = Command.make("scrub", { dryRun, json }, (args) =>
  // this command is the start-up scrub (and `--dry-run` must change nothing), so none runs before it
  edge({ json: args.json, scrub: false })(
    Effect.gen(function* () {
      const scrubber = yield* SecretScrubber
      const files = yield* scrubber.scrub({ dryRun: args.dryRun })
      const states = yield* scanMemoryStates()
      const byPath = (a: { readonly path: string }, b: { readonly path: string }) =>
        a.path.localeCompare(b.path)
      const report: Report = {
        ...files,
        memoryStatesScanned: states.statesScanned,
        findings: [...files.findings, ...states.findings].sort(byPath),
        problems: [...files.problems, ...states.problems].sort(byPath)
      }
      // docs/cli-json.md: one object, `dryRun` at the top like gc and prune
      if (args.json) yield* printJson(report)
      else yield* Console.log(reportText(report))
    })
  )
).pipe(
  Command.withDescription(
    "remove leftover plaintext secrets from config.raw and guest-config.json (runs on every start); report any found in suspended sessions' memory states. Example: abox scrub --dry-run --json"
  )
)
