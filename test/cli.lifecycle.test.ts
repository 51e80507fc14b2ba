/**
 * The built CLI as a user runs it, over the fake backend (the real guest agent as a host
 * process): run/resume, exit statuses, JSON lines, concurrent resumes, and SIGTERM mid-turn.
 * The same paths on a real VM are in test/e2e-cli.test.ts.
 */
import { describe, expect, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as path from "node:path"
import {
  cliBundle,
  fileChecksums,
  firstExits,
  runCli,
  startCli as startBundle,
  tempHome,
  withCliAndSource
} from "./cliHelpers.js"
import { processesMentioning } from "./support/processes.js"

const fake = { ABOX_VMM: "fake" }
const sourceDir = withCliAndSource()

const sessionFiles = (home: string, id: string) => fileChecksums(path.join(home, "sessions", id))

const startCli = (home: string, args: ReadonlyArray<string>) =>
  startBundle(cliBundle, args, {
    PATH: process.env.PATH ?? "",
    HOME: path.join(home, "user"),
    ABOX_HOME: home,
    ...fake
  })

describe("abox run / resume (built CLI, fake backend)", () => {
  it("run --json: the session id first, then every event; the exit status is the turn's", () => {
    const home = tempHome()
    const r = runCli(
      home,
      ["run", "--json", sourceDir(), "--", "echo", "out;", "echo", "written", ">", "f.txt;", "exit", "3"],
      fake
    )
    expect(r.code).toBe(3)
    const lines = r.stdout
      .trim()
      .split("\n")
      .map((l) => JSON.parse(l) as Record<string, unknown>)
    expect(Object.keys(lines[0]!)).toContain("session")
    expect(lines.at(-1)).toMatchObject({ event: { _tag: "End", exitCode: 3 } })
    expect(lines.some((l) => JSON.stringify(l).includes('"data":"out\\n"'))).toBe(true)
    const id = lines[0]!.session as string
    const again = runCli(home, ["resume", id, "--", "cat", "f.txt"], fake)
    expect(again.code).toBe(0)
    expect(again.stdout).toBe("written\n")
  })

  it("10 concurrent resumes: exactly one boots, the others fail SessionBusy fast and change nothing", async () => {
    const home = tempHome()
    const first = runCli(home, ["run", "--json", sourceDir(), "--", "true"], fake)
    const id = (JSON.parse(first.stdout.split("\n")[0]!) as { session: string }).session

    // a holder that has booted keeps the session until the others are done (then SIGTERM)
    const holder = startCli(home, ["resume", id, "--", "echo booted; sleep 300"])
    await holder.sees("booted")
    const before = sessionFiles(home, id)
    const losers = await Promise.all(
      Array.from({ length: 9 }, () => startCli(home, ["resume", id, "--json", "--", "true"]).exited)
    )
    for (const loser of losers) {
      expect(loser.code).toBe(75)
      expect(JSON.parse(loser.stdout)).toMatchObject({ error: { _tag: "SessionBusy", sessionId: id } })
    }
    expect(sessionFiles(home, id)).toEqual(before)
    holder.child.kill("SIGTERM")
    expect((await holder.exited).code).toBe(143)

    // a real race: ten at once; nine lose while the winner still holds the session
    const racers = Array.from({ length: 10 }, () =>
      startCli(home, ["resume", id, "--", "echo won; sleep 300"])
    )
    const outcomes = await firstExits(racers, 9)
    expect(outcomes.map((o) => o.code)).toEqual(Array(9).fill(75))
    const winner = racers.find((r) => !outcomes.some((o) => o.racer === r))!
    await winner.sees("won")
    winner.child.kill("SIGTERM")
    expect((await winner.exited).code).toBe(143)
  })

  it("SIGTERM during a turn: the one close path, exit 143, the close recorded, no process left", async () => {
    const home = tempHome()
    const run = startCli(home, ["run", sourceDir(), "--", "echo started; sleep 60"])
    await run.sees("started")
    const signalled = Date.now()
    run.child.kill("SIGTERM")
    const exit = await run.exited
    expect(exit.code).toBe(143)
    expect(exit.at - signalled).toBeLessThan(20_000)
    const id = fs.readdirSync(path.join(home, "sessions")).find((d) => !d.startsWith("."))!
    const meta = JSON.parse(fs.readFileSync(path.join(home, "sessions", id, "session.json"), "utf8")) as {
      lastClose?: { how: string }
    }
    expect(meta.lastClose?.how).toBe("graceful")
    expect(processesMentioning(home)).toEqual([])
  })

  it("a reader that goes away (| head -1): the session closes cleanly, exit 141, no crash", async () => {
    const home = tempHome()
    const run = startCli(home, [
      "run",
      "--json",
      sourceDir(),
      "--",
      "echo first; sleep 1; echo second; sleep 1; echo third"
    ])
    await run.sees("session")
    run.child.stdout.destroy()
    const exit = await run.exited
    expect(exit.code).toBe(141)
    expect(exit.stderr).not.toContain("EPIPE")
    const id = fs.readdirSync(path.join(home, "sessions")).find((d) => !d.startsWith("."))!
    const meta = JSON.parse(fs.readFileSync(path.join(home, "sessions", id, "session.json"), "utf8")) as {
      lastClose?: { how: string }
    }
    expect(meta.lastClose?.how).toBe("graceful")
    expect(processesMentioning(home)).toEqual([])
  })

  it("resume without an id is refused; resume of an unknown id says so", () => {
    const home = tempHome()
    expect(runCli(home, ["resume"], fake).code).toBe(64)
    const r = runCli(home, ["resume", "--json", "nope", "--", "true"], fake)
    expect(r.code).toBe(65)
    expect(JSON.parse(r.stdout)).toMatchObject({ error: { _tag: "SessionNotFound" } })
  })
})
