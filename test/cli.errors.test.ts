/**
 * Every failure goes through the one error edge, @effect/cli's own validation included: one
 * `abox: …` line on stderr (or exactly one `{"error":…}` object on stdout with --json) and the
 * code docs/exit-codes.md gives its tag.
 */
import { describe, expect, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as path from "node:path"
import { makeSessionCa } from "../src/broker/ca.js"
import { exitCodeFor } from "../src/cli/exitCodes.js"
import { runCli, tempHome, withCliAndSource, writeSession } from "./cliHelpers.js"

const sourceDir = withCliAndSource()
const fake = { ABOX_VMM: "fake" }

const cases = (
  source: string,
  home: string
): ReadonlyArray<readonly [ReadonlyArray<string>, string, RegExp]> => [
  [["run", "/nope", "--", "ls"], "SourceInvalid", /\/nope/],
  [["run", "--bogus", source, "--", "ls"], "ValidationError", /unknown option --bogus/],
  [
    ["run", "--policy", path.join(home, "none.json"), source, "--", "ls"],
    "BrokerPolicyError",
    /does not exist/
  ],
  [["run", "--cpus", "many", source, "--", "ls"], "ValidationError", /many/],
  [["list", "--bogus"], "ValidationError", /--bogus/],
  [["show"], "ValidationError", /Missing argument/],
  [["show", "--bogus"], "ValidationError", /unknown option --bogus/],
  [["rm", "-x"], "ValidationError", /unknown option -x/],
  [["nosuchcommand"], "ValidationError", /subcommand/]
]

describe("the one error edge", () => {
  it("each failure: one `abox:` line on stderr, nothing on stdout, the documented code", () => {
    const home = tempHome()
    for (const [args, tag, text] of cases(sourceDir(), home)) {
      const r = runCli(home, args, fake)
      expect({ args, code: r.code }).toEqual({ args, code: exitCodeFor(tag) })
      expect(r.stdout).toBe("")
      expect(r.stderr).toMatch(/^abox: [^\n]+\n$/)
      expect(r.stderr).toMatch(text)
    }
    expect(
      fs.existsSync(path.join(home, "sessions")) ? fs.readdirSync(path.join(home, "sessions")) : []
    ).toEqual([])
  })

  it("with --json: exactly one error object on stdout with the tag, the documented code", () => {
    const home = tempHome()
    for (const [args, tag, text] of cases(sourceDir(), home)) {
      if (args.length === 1 && args[0] === "nosuchcommand") continue
      const r = runCli(home, [...args.slice(0, 1), "--json", ...args.slice(1)], fake)
      expect({ args, code: r.code }).toEqual({ args, code: exitCodeFor(tag) })
      const parsed = JSON.parse(r.stdout) as { error: { _tag: string; message: string } }
      expect(parsed.error._tag).toBe(tag)
      expect(parsed.error.message).toMatch(text)
      expect(r.stderr).toBe("")
    }
  })

  it("--help, --version and completions still print", () => {
    const home = tempHome()
    expect(runCli(home, ["--version"]).stdout).toContain("0.1.0")
    expect(runCli(home, ["run", "--help"]).stdout).toContain("USAGE")
    expect(runCli(home, ["--completions", "bash"]).stdout).toContain("complete")
    // piped: no colour; usage lines name the program; no type boilerplate, no internal words; an example each
    for (const cmd of [
      "run",
      "open",
      "resume",
      "list",
      "show",
      "logs",
      "name",
      "rm",
      "prune",
      "gc",
      "scrub",
      "doctor"
    ]) {
      const help = runCli(home, [cmd, "--help"]).stdout
      expect(help).not.toMatch(/\u001b\[/)
      expect(help).toMatch(new RegExp(`^\\$ abox ${cmd}\\b`, "m"))
      expect(help).not.toMatch(/A user-defined piece of text|A true or false value|seed 00/)
      expect(help).toContain("Example: abox ")
    }
  })
})

describe("errors that escaped their types", () => {
  it("gc that cannot remove a file: StoreIoError (68), one line, no stack trace", () => {
    const home = tempHome()
    const dir = writeSession(path.join(home, "sessions"), "01aaaaaaaaaaaaaaaaaaaaaaaa")
    // a directory where gc expects an interrupted write's temp file: fs.rm without recursion fails
    fs.mkdirSync(path.join(dir, ".session.json.tmp-1"))
    fs.writeFileSync(path.join(dir, ".session.json.tmp-1", "x"), "")
    const r = runCli(home, ["gc"])
    expect(r.code).toBe(exitCodeFor("StoreIoError"))
    expect(r.stderr).toMatch(/^abox: cannot remove .*\.session\.json\.tmp-1[^\n]*\n$/)
  })

  it("ABOX_QEMU_ACCEL and ABOX_VMM are checked: ConfigInvalid (64) before anything runs", () => {
    const home = tempHome()
    const accel = runCli(home, ["run", sourceDir(), "--", "true"], { ABOX_QEMU_ACCEL: "foo" })
    expect(accel.code).toBe(exitCodeFor("ConfigInvalid"))
    expect(accel.stderr).toMatch(/^abox: ABOX_QEMU_ACCEL: [^\n]*foo[^\n]*\n$/)
    const vmm = runCli(home, ["list", "--json"], { ABOX_VMM: "bochs" })
    expect(vmm.code).toBe(exitCodeFor("ConfigInvalid"))
    expect((JSON.parse(vmm.stdout) as { error: { _tag: string } }).error._tag).toBe("ConfigInvalid")
    expect(fs.existsSync(path.join(home, "sessions"))).toBe(false)
  })
})

describe("bad values said in words, before anything is made", () => {
  it("--cpus 0 and --memory 16: InvalidOption (64); nothing made, nothing booted", () => {
    const home = tempHome()
    for (const [flag, value] of [
      ["--cpus", "0"],
      ["--memory", "16"]
    ] as const) {
      const r = runCli(home, ["run", flag, value, sourceDir(), "--", "true"], fake)
      expect(r.code).toBe(exitCodeFor("InvalidOption"))
      expect(r.stderr).toMatch(new RegExp(`^abox: ${flag} ${value}: a VM gets`))
    }
    expect(
      fs.existsSync(path.join(home, "sessions")) ? fs.readdirSync(path.join(home, "sessions")) : []
    ).toEqual([])
  })

  it("an invalid policy names the field in words; doctor checks $ABOX_HOME/broker.json", () => {
    const home = tempHome()
    const policy = path.join(home, "broker.json")
    fs.writeFileSync(policy, JSON.stringify({ format: 1, allow: [{ host: "api.example", ports: [0] }] }))
    const r = runCli(home, ["run", "--policy", policy, sourceDir(), "--", "true"], fake)
    expect(r.code).toBe(exitCodeFor("BrokerPolicyError"))
    expect(r.stderr).toContain("allow[0].ports[0]: Expected a number between 1 and 65535, actual 0")
    expect(r.stderr).not.toMatch(/parseJson|Struct|<->/)
    const doctor = runCli(home, ["doctor", "--json"], fake)
    expect(doctor.code).toBe(1)
    const checks = (
      JSON.parse(doctor.stdout) as { checks: Array<{ name: string; status: string; detail: string }> }
    ).checks
    expect(checks.find((c) => c.name === "broker")).toMatchObject({ status: "fail" })
    expect(checks.find((c) => c.name === "broker")?.detail).toContain("allow[0].ports[0]")
  })
})

describe("guestCaFiles", () => {
  it("doctor lists what the guest will trust; a CA file holding a key stops the session, naming the file", async () => {
    const home = tempHome()
    const ca = await makeSessionCa({ commonName: "Example Corp Inspection CA" })
    const good = path.join(home, "corp-ca.pem")
    const bad = path.join(home, "corp-with-key.pem")
    fs.writeFileSync(good, ca.certPem)
    fs.writeFileSync(bad, `${ca.certPem}${ca.leaf("x.example").keyPem}`)
    const policy = path.join(home, "broker.json")
    fs.writeFileSync(policy, JSON.stringify({ format: 1, allow: [], guestCaFiles: [good, bad] }))
    const doctor = runCli(home, ["doctor", "--json"], fake)
    const checks = (
      JSON.parse(doctor.stdout) as { checks: Array<{ name: string; status: string; detail: string }> }
    ).checks.filter((c) => c.name === "guest-ca")
    expect(checks.map((c) => c.status)).toEqual(["ok", "fail"])
    expect(checks[0]!.detail).toContain("Example Corp Inspection CA")
    expect(checks[1]!.detail).toContain(bad)
    expect(checks[1]!.detail).toContain("PRIVATE KEY block")
    const r = runCli(home, ["run", "--policy", policy, sourceDir(), "--", "true"], fake)
    expect(r.code).toBe(exitCodeFor("BrokerError"))
    expect(r.stderr).toContain(`the guest CA file ${bad} (policy guestCaFiles) is not usable`)
    expect(r.stderr).not.toContain("BEGIN RSA PRIVATE KEY")
  })
})

describe("names", () => {
  it("a name that is a session id (or looks like one) is refused, so rm <id> cannot reach another session", () => {
    const home = tempHome()
    const sessions = path.join(home, "sessions")
    const A = "01aaaaaaaaaaaaaaaaaaaaaaaa"
    const B = "01bbbbbbbbbbbbbbbbbbbbbbbb"
    writeSession(sessions, A)
    writeSession(sessions, B)
    writeSession(sessions, "plain")
    for (const name of [A, "01cccccccccccccccccccccccc", "plain"]) {
      const r = runCli(home, ["name", B, name])
      expect(r.code).toBe(exitCodeFor("InvalidName"))
      expect(r.stderr).toMatch(/^abox: .*(session id|id of a session)/)
    }
    expect(fs.existsSync(path.join(home, "names"))).toBe(false)
  })
})
