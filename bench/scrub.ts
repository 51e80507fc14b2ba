import * as path from "node:path"
import { type BenchContext, cli, compare, comparedFigure, type Figure, makeHome, timeOnce } from "./lib.js"

const SESSIONS = 1000

/** the start-up scrub's cost: `abox list --json` with it vs with ABOX_SKIP_SCRUB=1 (goal ≤ 1.2×) */
export const scrubOverhead = async (ctx: BenchContext): Promise<Figure> => {
  const home = makeHome(ctx.tmp, SESSIONS)
  const env = { ABOX_HOME: home, HOME: path.join(ctx.tmp, "user") }
  const m = compare(
    ctx.runs,
    () => timeOnce([process.execPath, cli, "list", "--json"], env),
    () => timeOnce([process.execPath, cli, "list", "--json"], { ...env, ABOX_SKIP_SCRUB: "1" })
  )
  return comparedFigure(m, ctx.runs, {
    goal: 1.2,
    note: `${SESSIONS} sessions, each with session.json, guest-config.json and config.raw`
  })
}
