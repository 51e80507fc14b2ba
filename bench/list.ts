import * as path from "node:path"
import { type BenchContext, cli, compare, comparedFigure, type Figure, makeHome, timeOnce } from "./lib.js"

const SESSIONS = 1000

/**
 * The floor: a bare node process that reads the same session.json files and prints them as
 * JSON (no schema, no CLI framework). What `abox list --json` costs above that is abox's.
 */
const floorScript = `
const fs = require("node:fs"), path = require("node:path");
const dir = path.join(process.env.ABOX_HOME, "sessions");
const out = fs.readdirSync(dir).sort().map((id) => JSON.parse(fs.readFileSync(path.join(dir, id, "session.json"), "utf8")));
process.stdout.write(JSON.stringify({ sessions: out }, null, 2) + "\\n");
`

/** `abox list --json` over 1,000 sessions vs the floor (start-up scrub skipped: see scrubOverhead) */
export const listVsFloor = async (ctx: BenchContext): Promise<Figure> => {
  const home = makeHome(ctx.tmp, SESSIONS)
  const env = { ABOX_HOME: home, HOME: path.join(ctx.tmp, "user"), ABOX_SKIP_SCRUB: "1" }
  const m = compare(
    ctx.runs,
    () => timeOnce([process.execPath, cli, "list", "--json"], env),
    () => timeOnce([process.execPath, "-e", floorScript], env)
  )
  return comparedFigure(m, ctx.runs, { note: `${SESSIONS} sessions` })
}

/**
 * `abox list --json` with an empty ABOX_HOME vs `node -e 0`: what the CLI's start-up costs above
 * node's own (loading and evaluating the command's modules, building its services, parsing)
 */
export const listEmptyVsNode = async (ctx: BenchContext): Promise<Figure> => {
  const home = path.join(ctx.tmp, "empty-home")
  const env = { ABOX_HOME: home, HOME: path.join(ctx.tmp, "user") }
  const m = compare(
    ctx.runs,
    () => timeOnce([process.execPath, cli, "list", "--json"], env),
    () => timeOnce([process.execPath, "-e", "0"], env)
  )
  return comparedFigure(m, ctx.runs, { goal: 2.5, note: "empty home" })
}
