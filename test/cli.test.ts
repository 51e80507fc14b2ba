import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import { spawn, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { exitCodeFor } from "../src/cli/exitCodes.js"
import { buildCli, cliBundle, removeTempHomes, runCli, tempHome, writeSession } from "./cliHelpers.js"

const A = "01aaaaaaaaaaaaaaaaaaaaaaaa"
const B = "01bbbbbbbbbbbbbbbbbbbbbbbb"
const C = "01cccccccccccccccccccccccc"

beforeAll(buildCli, 120_000)
afterAll(removeTempHomes)

const setup = () => {
  const home = tempHome()
  const sessions = path.join(home, "sessions")
  writeSession(sessions, A)
  writeSession(sessions, B, '{"format":1,"id":')
  const legacy = path.join(home, "user", "Library", "Application Support", "ABox", "sessions")
  writeSession(legacy, "legacy-one")
  return { home, sessions, legacy }
}

/** util-linux `script` gives the CLI a pseudo-terminal, so `rm` asks */
const hasScript = spawnSync("script", ["--version"], { stdio: "ignore" }).status === 0

/** run `abox rm <ref>` on a pty; answer `key` once the question is on screen (an event, not a sleep) */
const rmOnTerminal = (home: string, ref: string, key: string) =>
  new Promise<{ code: number | null; output: string }>((resolve, reject) => {
    const child = spawn("script", ["-qec", `${process.execPath} ${cliBundle} rm ${ref}`, "/dev/null"], {
      env: { PATH: process.env.PATH ?? "", HOME: path.join(home, "user"), ABOX_HOME: home, TERM: "dumb" },
      stdio: ["pipe", "pipe", "pipe"]
    })
    let output = ""
    let answered = false
    child.stdout.on("data", (chunk: Buffer) => {
      output += chunk.toString("utf8")
      if (!answered && output.includes("(y/N)")) {
        answered = true
        child.stdin.write(key)
        child.stdin.write("\r")
      }
    })
    child.on("error", reject)
    child.on("close", (code) => resolve({ code, output }))
  })

const parse = (s: string) => JSON.parse(s) as Record<string, unknown>

describe("abox CLI (built bundle, real processes)", () => {
  it("--version and --help", () => {
    const home = tempHome()
    const v = runCli(home, ["--version"])
    expect(v.code).toBe(0)
    expect(v.stdout).toContain("0.1.0")
    for (const cmd of [[], ["list"], ["show"], ["name"], ["rm"], ["scrub"]]) {
      const h = runCli(home, [...cmd, "--help"])
      expect(h.code).toBe(0)
      expect(h.stdout).toContain("USAGE")
    }
  })

  it("list: ok, corrupt (with the reason) and legacy sessions; --json", () => {
    const { home } = setup()
    const text = runCli(home, ["list"])
    expect(text.code).toBe(0)
    expect(text.stdout).toContain(A)
    expect(text.stdout).toMatch(new RegExp(`${B}\\s+STOPPED\\s+\\S+ \\S+\\s+-\\s+CORRUPT: .*not valid JSON`))
    expect(text.stdout).toMatch(/legacy-one.*\[legacy\]/)
    const json = runCli(home, ["list", "--json"])
    expect(json.code).toBe(0)
    const rows = parse(json.stdout).sessions as Array<Record<string, unknown>>
    expect(rows.map((r) => [r.id, r.status, r.legacy])).toEqual([
      [A, "ok", false],
      [B, "corrupt", false],
      ["legacy-one", "ok", true]
    ])
    expect((rows[1]!.error as Record<string, unknown>)._tag).toBe("SessionCorrupt")
  })

  it("list of an empty or absent home", () => {
    const home = path.join(tempHome(), "not-yet")
    const r = runCli(home, ["list", "--json"])
    expect(r.code).toBe(0)
    expect(parse(r.stdout)).toEqual({ sessions: [] })
  })

  it("show: by id and by name; a corrupt session exits with its typed error", () => {
    const { home } = setup()
    const byId = runCli(home, ["show", A, "--json"])
    expect(byId.code).toBe(0)
    expect((parse(byId.stdout).session as Record<string, unknown>).id).toBe(A)
    expect(runCli(home, ["name", A, "web app"]).code).toBe(0)
    const byName = runCli(home, ["show", "web app"])
    expect(byName.code).toBe(0)
    expect(byName.stdout).toMatch(/names:\s+web app/)

    const corrupt = runCli(home, ["show", B])
    expect(corrupt.code).toBe(exitCodeFor("SessionCorrupt"))
    expect(corrupt.stderr.trim().split("\n")).toHaveLength(1)
    expect(corrupt.stderr).toContain("session.json")
    const corruptJson = runCli(home, ["show", B, "--json"])
    expect(corruptJson.code).toBe(exitCodeFor("SessionCorrupt"))
    const error = parse(corruptJson.stdout).error as Record<string, unknown>
    expect(Object.keys(parse(corruptJson.stdout))).toEqual(["error"])
    expect(error._tag).toBe("SessionCorrupt")
    expect(typeof error.message).toBe("string")
    expect(String(error.path)).toMatch(/session\.json$/)
    expect(typeof error.reason).toBe("string")
  })

  it("errors: not found, too new, invalid name, name taken, usage", () => {
    const { home, sessions } = setup()
    writeSession(sessions, C, { format: 9 })
    const cases: Array<[ReadonlyArray<string>, string]> = [
      [["show", "nope", "--json"], "SessionNotFound"],
      [["show", C, "--json"], "SessionFormatTooNew"],
      [["name", A, "..", "--json"], "InvalidName"]
    ]
    for (const [args, tag] of cases) {
      const r = runCli(home, args)
      expect(r.code).toBe(exitCodeFor(tag))
      expect((parse(r.stdout).error as Record<string, unknown>)._tag).toBe(tag)
    }
    expect(runCli(home, ["name", A, "a/b"]).code).toBe(0)
    const taken = runCli(home, ["name", "legacy-one", "a_b", "--json"])
    expect(taken.code).toBe(exitCodeFor("NameTaken"))
    expect((parse(taken.stdout).error as Record<string, unknown>).message).toContain('"a/b"')
    expect(runCli(home, ["show"]).code).toBe(exitCodeFor("ValidationError"))
    expect(runCli(home, ["list", "--no-such-flag"]).code).toBe(exitCodeFor("ValidationError"))
  })

  it("rm: refuses without --yes on a non-terminal and deletes nothing; --yes removes dir and names", () => {
    const { home, sessions } = setup()
    expect(runCli(home, ["name", A, "doomed"]).code).toBe(0)
    const before = fs.readdirSync(sessions).sort()
    const refused = runCli(home, ["rm", "doomed"])
    expect(refused.code).toBe(exitCodeFor("ConfirmationRequired"))
    expect(refused.stderr).toContain("--yes")
    expect(fs.readdirSync(sessions).sort()).toEqual(before)
    expect(fs.existsSync(path.join(home, "names", "doomed.json"))).toBe(true)

    const removed = runCli(home, ["rm", "doomed", "--yes", "--json"])
    expect(removed.code).toBe(0)
    expect(parse(removed.stdout)).toEqual({
      removed: [{ sessionId: A, names: ["doomed"], bytes: expect.any(Number) }]
    })
    expect(fs.existsSync(path.join(sessions, A))).toBe(false)
    expect(fs.existsSync(path.join(home, "names", "doomed.json"))).toBe(false)
    // a corrupt session can be removed too; a legacy one never
    expect(runCli(home, ["rm", B, "--yes"]).code).toBe(0)
    const legacy = runCli(home, ["rm", "legacy-one", "--yes", "--json"])
    expect(legacy.code).toBe(exitCodeFor("StoreIoError"))
    expect(
      fs.existsSync(
        path.join(home, "user", "Library", "Application Support", "ABox", "sessions", "legacy-one")
      )
    ).toBe(true)
  })

  it.skipIf(!hasScript)(
    "rm on a terminal asks: no keeps the session (Cancelled), yes deletes it",
    async () => {
      const { home, sessions } = setup()
      const no = await rmOnTerminal(home, A, "n")
      expect(no.output).toContain("cannot be undone")
      expect(no.code).toBe(exitCodeFor("Cancelled"))
      expect(fs.existsSync(path.join(sessions, A))).toBe(true)
      const yes = await rmOnTerminal(home, A, "y")
      expect(yes.code).toBe(0)
      expect(yes.output).toContain(`removed ${A}`)
      expect(fs.existsSync(path.join(sessions, A))).toBe(false)
    }
  )

  it("rm of a dangling name removes just the name", () => {
    const { home, sessions } = setup()
    expect(runCli(home, ["name", A, "ghost"]).code).toBe(0)
    fs.rmSync(path.join(sessions, A), { recursive: true })
    const show = runCli(home, ["show", "ghost"])
    expect(show.code).toBe(exitCodeFor("SessionNotFound"))
    expect(show.stderr).toContain("dangling")
    expect(runCli(home, ["rm", "ghost", "--yes"]).code).toBe(0)
    expect(fs.existsSync(path.join(home, "names", "ghost.json"))).toBe(false)
  })

  it("every command scrubs first (unless ABOX_SKIP_SCRUB=1); scrub --dry-run changes nothing", () => {
    const { home, sessions } = setup()
    const file = path.join(sessions, A, "guest-config.json")
    const secret = "sk-ant-api03-" + "Q".repeat(80)
    const dirty = JSON.stringify({ format: 1, sessionId: A, model: "default", apiKey: secret })
    fs.writeFileSync(file, dirty, { mode: 0o600 })
    const dry = runCli(home, ["scrub", "--dry-run", "--json"])
    expect(dry.code).toBe(0)
    expect(dry.stdout).not.toContain(secret)
    const findings = (parse(dry.stdout) as { findings: Array<{ path: string; changed: boolean }> }).findings
    expect(findings.map((f) => [f.path, f.changed])).toEqual([[file, false]])
    expect(fs.readFileSync(file, "utf8")).toBe(dirty)
    expect(runCli(home, ["list"], { ABOX_SKIP_SCRUB: "1" }).code).toBe(0)
    expect(fs.readFileSync(file, "utf8")).toBe(dirty)
    const listed = runCli(home, ["list", "--json"])
    expect(listed.code).toBe(0)
    expect(listed.stderr).toContain("removed leftover secrets from 1 file")
    expect(fs.readFileSync(file, "utf8")).not.toContain(secret)
    expect(fs.existsSync(path.join(sessions, A, "session.json"))).toBe(true)
  })

  it("scrub --dry-run and --json report without changing session files", () => {
    const { home, sessions } = setup()
    const file = path.join(sessions, A, "session.json")
    const before = fs.readFileSync(file)
    const dry = runCli(home, ["scrub", "--dry-run", "--json"])
    expect(dry.code).toBe(0)
    // docs/cli-json.md: one object, `dryRun` at the top level as in gc and prune
    const report = parse(dry.stdout)
    expect(Object.keys(report).sort()).toEqual([
      "dryRun",
      "filesScanned",
      "findings",
      "memoryStatesScanned",
      "problems",
      "sessionsScanned"
    ])
    expect(report.dryRun).toBe(true)
    expect(Array.isArray(report.findings)).toBe(true)
    expect(runCli(home, ["scrub"]).code).toBe(0)
    expect(fs.readFileSync(file).equals(before)).toBe(true)
  })
})
