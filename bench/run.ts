/**
 * `npm run bench`: builds, then prints one JSON object of named figures. Each figure is a
 * ratio against a floor measured in the same run (medians of BENCH_RUNS runs, default 7).
 * To add a figure: a file under bench/ exporting `(ctx: BenchContext) => Promise<Figure>`,
 * and one line in `figures` below.
 */
import * as fs from "node:fs"
import { agentFileToolRoundTrip, agentFirstRequest, agentToolRoundTrip } from "./agent.js"
import { detachedExec } from "./detached.js"
import { envBuild, envDisk, envOpen } from "./environment.js"
import { brokerDownload, brokerDownloadPassthrough, brokerRequests } from "./broker.js"
import { brokerLogBurst } from "./brokerLog.js"
import { type BenchContext, type Figure, tempRoot } from "./lib.js"
import { lifecycleRss, lifecycleRun, lifecycleTurn, transferTree50MB } from "./lifecycle.js"
import { listEmptyVsNode, listVsFloor } from "./list.js"
import { muxRoundTrip, transfer50MB, turnRoundTrip } from "./protocol.js"
import { repoOpen200MB, repoOpenNodeModules, repoOpenTinyFiles } from "./repo.js"
import { imageImport } from "./imageImport.js"
import { scrubOverhead } from "./scrub.js"
import { turnOutputStream } from "./turnOutput.js"
import { vmmOpenToHello, vmmRss } from "./vmm.js"
import { cowDiskThroughput, cowIdleRss, cowMainJob5, cowSessionDisk, cowSessions20, vmmClone } from "./cow.js"

const figures: ReadonlyArray<readonly [string, (ctx: BenchContext) => Promise<Figure>]> = [
  ["listVsFloor", listVsFloor],
  ["listEmptyVsNode", listEmptyVsNode],
  ["scrubOverhead", scrubOverhead],
  ["brokerDownload", brokerDownload],
  ["brokerDownloadPassthrough", brokerDownloadPassthrough],
  ["brokerRequests", brokerRequests],
  ["brokerLogBurst", brokerLogBurst],
  ["turnRoundTrip", turnRoundTrip],
  ["muxRoundTrip", muxRoundTrip],
  ["transfer50MB", transfer50MB],
  ["vmmOpenToHello", vmmOpenToHello],
  ["vmmClone", vmmClone],
  ["vmmRss", vmmRss],
  ["cowMainJob5", cowMainJob5],
  ["cowSessionDisk", cowSessionDisk],
  ["cowSessions20", cowSessions20],
  ["cowDiskThroughput", cowDiskThroughput],
  ["cowIdleRss", cowIdleRss],
  ["lifecycleRun", lifecycleRun],
  ["lifecycleTurn", lifecycleTurn],
  ["transferTree50MB", transferTree50MB],
  ["lifecycleRss", lifecycleRss],
  ["repoOpenNodeModules", repoOpenNodeModules],
  ["repoOpenTinyFiles", repoOpenTinyFiles],
  ["repoOpen200MB", repoOpen200MB],
  ["agentFirstRequest", agentFirstRequest],
  ["agentToolRoundTrip", agentToolRoundTrip],
  ["agentFileToolRoundTrip", agentFileToolRoundTrip],
  ["detachedExec", detachedExec],
  ["turnOutputStream", turnOutputStream],
  ["imageImport", imageImport],
  ["envBuild", envBuild],
  ["envDisk", envDisk],
  ["envOpen", envOpen]
]

const only = process.argv.slice(2)
const ctx: BenchContext = { runs: Number(process.env.BENCH_RUNS ?? 7), tmp: tempRoot() }
const results: Record<string, Figure | { readonly error: string }> = {}
try {
  for (const [name, figure] of figures) {
    if (only.length > 0 && !only.includes(name)) continue
    try {
      results[name] = await figure(ctx)
    } catch (error) {
      results[name] = { error: error instanceof Error ? error.message : String(error) }
    }
  }
} finally {
  fs.rmSync(ctx.tmp, { recursive: true, force: true })
}
process.stdout.write(
  JSON.stringify(
    { node: process.version, cpus: (await import("node:os")).cpus().length, figures: results },
    null,
    2
  ) + "\n"
)
