/**
 * Removing sessions (built CLI, fake backend): rm refuses a running session and removes all or
 * nothing; run --rm; run without a turn; prune; status and disk usage in list and show.
 */
import { describe, expect, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as path from "node:path"
import { exitCodeFor } from "../src/cli/exitCodes.js"
import { cliBundle, runCli, startCli, tempHome, withCliAndSource, writeSession } from "./cliHelpers.js"

const fake = { ABOX_VMM: "fake" }
const sourceDir = withCliAndSource()
const sessionIds = (home: string) =>
  fs.existsSync(path.join(home, "sessions"))
    ? fs.readdirSync(path.join(home, "sessions")).filter((d) => !d.startsWith("."))
    : []

const A = "01aaaaaaaaaaaaaaaaaaaaaaaa"
const B = "01bbbbbbbbbbbbbbbbbbbbbbbb"
const C = "01cccccccccccccccccccccccc"

describe("abox rm, run --rm, prune", () => {
  it("a running session: rm refuses it (SessionBusy) and deletes nothing; list and show say RUNNING", async () => {
    const home = tempHome()
    const run = startCli(cliBundle, ["run", "--json", sourceDir(), "--", "echo started; sleep 60"], {
      PATH: process.env.PATH ?? "",
      HOME: path.join(home, "user"),
      ABOX_HOME: home,
      ...fake
    })
    await run.sees("started")
    const [id] = sessionIds(home)
    const refused = runCli(home, ["rm", id!, "--yes"], fake)
    expect(refused.code).toBe(exitCodeFor("SessionBusy"))
    expect(refused.stderr).toMatch(/^abox: session .* is running .*nothing was removed\n$/)
    expect(fs.existsSync(path.join(home, "sessions", id!, "session.json"))).toBe(true)
    expect(runCli(home, ["list"], fake).stdout).toMatch(new RegExp(`${id}\\s+RUNNING`))
    const shown = runCli(home, ["show", id!], fake).stdout
    expect(shown).toMatch(/status:\s+RUNNING/)
    expect(shown).not.toContain("last close")
    run.child.kill("SIGTERM")
    expect((await run.exited).code).toBe(143)
    expect(runCli(home, ["list"], fake).stdout).toMatch(
      new RegExp(`${id}\\s+STOPPED\\s+\\S+ \\S+\\s+-\\s+graceful`)
    )
    expect(runCli(home, ["rm", id!, "--yes"], fake).code).toBe(0)
    expect(sessionIds(home)).toEqual([])
  })

  it("rm takes several refs, all or nothing", () => {
    const home = tempHome()
    const sessions = path.join(home, "sessions")
    for (const id of [A, B, C]) writeSession(sessions, id)
    expect(runCli(home, ["name", B, "bee"]).code).toBe(0)
    const missing = runCli(home, ["rm", A, "nosuch", "--yes"])
    expect(missing.code).toBe(exitCodeFor("SessionNotFound"))
    expect(sessionIds(home).sort()).toEqual([A, B, C])
    const json = runCli(home, ["rm", A, "bee", "--yes", "--json"])
    expect(json.code).toBe(0)
    const removed = (
      JSON.parse(json.stdout) as { removed: Array<{ sessionId: string; names: Array<string> }> }
    ).removed
    expect(removed.map((r) => [r.sessionId, r.names])).toEqual([
      [A, []],
      [B, ["bee"]]
    ])
    expect(sessionIds(home)).toEqual([C])
    expect(fs.existsSync(path.join(home, "names", "bee.json"))).toBe(false)
  })

  it("run --rm removes the session after close, keeping the turn's status; without it the session stays and says so", () => {
    const home = tempHome()
    const r = runCli(home, ["run", "--rm", sourceDir(), "--", "echo hi; exit 3"], fake)
    expect(r.code).toBe(3)
    expect(r.stdout).toBe("hi\n")
    expect(sessionIds(home)).toEqual([])
    const kept = runCli(home, ["run", sourceDir(), "--", "true"], fake)
    expect(kept.code).toBe(0)
    const [id] = sessionIds(home)
    expect(kept.stderr).toContain(`abox rm ${id}`)
  })

  it("run without a turn is a usage error: nothing booted, nothing made", () => {
    const home = tempHome()
    for (const args of [
      ["run", sourceDir()],
      ["run", sourceDir(), "--"]
    ]) {
      const r = runCli(home, args, fake)
      expect(r.code).toBe(exitCodeFor("ValidationError"))
      expect(r.stderr).toMatch(/^abox: run needs a turn/)
    }
    expect(sessionIds(home)).toEqual([])
  })

  it("prune: --older-than by last use, --dry-run changes nothing, running and legacy sessions stay", () => {
    const home = tempHome()
    const sessions = path.join(home, "sessions")
    const old = "2020-01-01T00:00:00.000Z"
    const recent = new Date().toISOString()
    writeSession(sessions, A, { created: old })
    writeSession(sessions, B, {
      created: old,
      lastClose: { at: recent, how: "graceful", exitCode: 0, signal: null }
    })
    writeSession(sessions, C, { created: recent })

    const bad = runCli(home, ["prune", "--older-than", "soon"])
    expect(bad.code).toBe(exitCodeFor("ValidationError"))
    expect(bad.stderr).toContain("--older-than")

    const dry = runCli(home, ["prune", "--older-than", "7d", "--dry-run", "--json"])
    expect(dry.code).toBe(0)
    expect(JSON.parse(dry.stdout)).toMatchObject({ dryRun: true, removed: [{ sessionId: A }] })
    expect(sessionIds(home).sort()).toEqual([A, B, C])

    expect(runCli(home, ["prune", "--older-than", "7d"]).code).toBe(exitCodeFor("ConfirmationRequired"))
    expect(sessionIds(home).sort()).toEqual([A, B, C])

    const done = runCli(home, ["prune", "--older-than", "7d", "--yes"])
    expect(done.code).toBe(0)
    expect(done.stdout).toContain(`removed session ${A}`)
    expect(sessionIds(home).sort()).toEqual([B, C])
  })

  it("list has a header, status and size; show the disk usage", () => {
    const home = tempHome()
    const dir = writeSession(path.join(home, "sessions"), A)
    fs.writeFileSync(path.join(dir, "root.raw"), Buffer.alloc(300_000, 1))
    const text = runCli(home, ["list"]).stdout.split("\n")
    expect(text[0]).toMatch(/^ID\s+STATUS\s+SIZE\s+SHARED\s+LAST CLOSE/)
    expect(text[1]).toMatch(new RegExp(`^${A}\\s+STOPPED\\s+3\\d\\d kB\\s+-\\s+never`))
    const rows = (
      JSON.parse(runCli(home, ["list", "--json"]).stdout) as { sessions: Array<Record<string, unknown>> }
    ).sessions
    expect(rows[0]).toMatchObject({ id: A, running: false })
    expect(rows[0]!.bytes as number).toBeGreaterThanOrEqual(300_000)
    expect(runCli(home, ["show", A]).stdout).toMatch(/disk:\s+3\d\d kB/)
  })
})
