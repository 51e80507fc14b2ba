/**
 * The built CLI on a real VM (QEMU, the Debian cloud kernel, the real guest agent): what a user
 * does — run, resume, concurrent resumes, SIGTERM and SIGKILL mid-turn. Skipped with the reason
 * where QEMU or the image tools are missing; CI has them.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import { spawnSync } from "node:child_process"
import { createHash } from "node:crypto"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { fileChecksums, firstExits, startCli as startBundle } from "./cliHelpers.js"
import { ensureTestImage, processesMentioning, repoRoot, testHome, vmSkipReason } from "./e2e-vm-image.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e CLI tests skipped: ${skip}`)

const cli = path.join(repoRoot, "dist", "abox.js")
let home = ""
let source = ""
let kernel = ""

beforeAll(async () => {
  if (skip !== undefined) return
  const image = await ensureTestImage()
  kernel = image.identity.kernel ?? ""
  home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-cli-"))
  // the sessions are this test's own; the golden image is the shared test image
  fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
  source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-src-"))
  fs.writeFileSync(path.join(source, "README.md"), "e2e\n")
}, 600_000)
afterAll(() => {
  if (home !== "") fs.rmSync(home, { recursive: true, force: true })
  if (source !== "") fs.rmSync(source, { recursive: true, force: true })
})

const env = () => ({ PATH: process.env.PATH ?? "", HOME: os.homedir(), ABOX_HOME: home })

const runCli = (args: ReadonlyArray<string>) => {
  const r = spawnSync(process.execPath, [cli, ...args], { env: env(), encoding: "utf8", timeout: 300_000 })
  return { code: r.status, stdout: r.stdout, stderr: r.stderr }
}

const startCli = (args: ReadonlyArray<string>) => startBundle(cli, args, env())

// the disks the running guest writes (root, repository) are not compared
const sessionFiles = (id: string) =>
  fileChecksums(path.join(home, "sessions", id), ["root.raw", "root.qcow2", "repo-base.raw", "repo.qcow2", "repo.raw"])

/** until `check` holds or `ms` pass (the VM's exit is another process's event: watched, bounded) */
const within = async (ms: number, check: () => boolean) => {
  const deadline = Date.now() + ms
  while (!check() && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50))
  return check()
}

const newSession = () => {
  const r = runCli(["run", "--json", source, "--", "true"])
  expect(r.code, r.stderr).toBe(0)
  return (JSON.parse(r.stdout.split("\n")[0]!) as { session: string }).session
}

/** a session an earlier case left closed (gracefully, nothing running), or a new one: one boot less */
let closedSession: string | undefined
const aClosedSession = () => closedSession ?? newSession()

// each case boots one to three VMs: under TCG on a loaded host that is more than the default 60 s
describe.skipIf(skip !== undefined)("abox CLI on a real VM", { timeout: 300_000 }, () => {
  it("one boot: 100,000 random bytes through `abox run … > f` arrive byte for byte; a turn can neither ptrace nor make a user namespace", () => {
    const turn =
      "head -c 100000 /dev/urandom > /tmp/r; cat /tmp/r; " +
      "{ sha256sum < /tmp/r; cat /proc/sys/kernel/yama/ptrace_scope /proc/sys/user/max_user_namespaces; " +
      "if unshare -U true 2>/dev/null; then echo userns-allowed; else echo userns-refused; fi; } >&2"
    const r = spawnSync(process.execPath, [cli, "run", source, "--", turn], { env: env(), timeout: 300_000 })
    const stderr = r.stderr.toString("utf8")
    expect(r.status, stderr).toBe(0)
    const stdout: Buffer = r.stdout
    expect(stdout.length).toBe(100_000)
    const [hash, ptraceScope, maxUserNamespaces, userns] = stderr
      .split("\n")
      .filter((line) => !line.startsWith("abox:") && line.trim() !== "")
      .map((line) => line.trim())
    expect(createHash("sha256").update(stdout).digest("hex")).toBe(hash!.split(" ")[0])
    expect(ptraceScope).toBe("2")
    expect(maxUserNamespaces).toBe("0")
    expect(userns).toBe("userns-refused")
  })

  it("run prints the guest's output; a file written in one boot is there in the next (resume)", () => {
    const r = runCli(["run", "--json", source, "--", "echo persisted > made.txt; uname -r; cat README.md"])
    expect(r.code, r.stderr).toBe(0)
    const lines = r.stdout
      .trim()
      .split("\n")
      .map((l) => JSON.parse(l) as Record<string, unknown>)
    const id = lines[0]!.session as string
    const out = lines
      .map((l) => l.event as { _tag: string; event?: { kind: string; data?: string } } | undefined)
      .map((e) => (e?._tag === "Event" && e.event?.kind === "stdout" ? e.event.data : ""))
      .join("")
    expect(out).toBe(`${kernel}\ne2e\n`)
    const again = runCli(["resume", id, "--", "cat made.txt"])
    expect(again.code, again.stderr).toBe(0)
    expect(again.stdout).toBe("persisted\n")
    const meta = JSON.parse(fs.readFileSync(path.join(home, "sessions", id, "session.json"), "utf8")) as {
      lastClose: { how: string }
      vmm: { backend: string }
    }
    expect(meta.lastClose.how).toBe("graceful")
    expect(meta.vmm.backend).toBe("qemu")
    expect(processesMentioning(path.join(home, "sessions", id))).toEqual([])
    closedSession = id
  })

  it("10 concurrent resumes: one boots, nine fail SessionBusy quickly, nothing of the session changes", async () => {
    const id = aClosedSession()
    // the holder keeps the session until the others are done (then it is closed by SIGTERM)
    const holder = startCli(["resume", id, "--", "echo booted; sleep 300"])
    await holder.sees("booted")
    const before = sessionFiles(id)
    const started = Date.now()
    const losers = await Promise.all(
      Array.from({ length: 9 }, () => startCli(["resume", id, "--", "true"]).exited)
    )
    for (const loser of losers) {
      expect(loser.code).toBe(75)
      expect(loser.stderr).toContain(id)
      expect(loser.at - started).toBeLessThan(15_000)
    }
    expect(sessionFiles(id)).toEqual(before)
    holder.child.kill("SIGTERM")
    expect((await holder.exited).code).toBe(143)

    // a real race: ten at once; nine lose while the winner still holds the session
    const racers = Array.from({ length: 10 }, () => startCli(["resume", id, "--", "echo won; sleep 300"]))
    const outcomes = await firstExits(racers, 9)
    expect(outcomes.map((o) => o.code)).toEqual(Array(9).fill(75))
    const winner = racers.find((r) => !outcomes.some((o) => o.racer === r))!
    await winner.sees("won")
    winner.child.kill("SIGTERM")
    expect((await winner.exited).code).toBe(143)
  })

  it("SIGTERM during a turn: a clean close (graceful), exit 143, no process left", async () => {
    const run = startCli(["run", "--json", source, "--", "echo started; sleep 120"])
    await run.sees("started")
    run.child.kill("SIGTERM")
    const exit = await run.exited
    expect(exit.code).toBe(143)
    const session = (JSON.parse(exit.stdout.split("\n")[0]!) as { session: string }).session
    const meta = JSON.parse(
      fs.readFileSync(path.join(home, "sessions", session, "session.json"), "utf8")
    ) as {
      lastClose: { how: string }
    }
    expect(meta.lastClose.how).toBe("graceful")
    expect(processesMentioning(path.join(home, "sessions", session))).toEqual([])
  })

  it("SIGKILL of abox mid-turn: the helper stops the VM within 3 s and the session resumes", async () => {
    const run = startCli(["run", "--json", source, "--", "echo started; sleep 120"])
    await run.sees("started")
    run.child.kill("SIGKILL")
    const exit = await run.exited
    const id = (JSON.parse(exit.stdout.split("\n")[0]!) as { session: string }).session
    const dir = path.join(home, "sessions", id)
    expect(await within(3_000, () => processesMentioning(dir).length === 0)).toBe(true)
    const again = runCli(["resume", id, "--", "echo back"])
    expect(again.code, again.stderr).toBe(0)
    expect(again.stdout).toBe("back\n")
  })

  it("a second signal exits at once; the helper still stops the VM", async () => {
    const run = startCli(["run", "--json", source, "--", "echo started; sleep 120"])
    await run.sees("started")
    run.child.kill("SIGTERM")
    await run.seesOnStderr("closing")
    const second = Date.now()
    run.child.kill("SIGTERM")
    const exit = await run.exited
    // the operating system's default action ended it (a closed session exits 143 instead)
    expect(exit.signal).toBe("SIGTERM")
    expect(exit.at - second).toBeLessThan(2_000)
    const id = (JSON.parse(exit.stdout.split("\n")[0]!) as { session: string }).session
    expect(await within(3_000, () => processesMentioning(path.join(home, "sessions", id)).length === 0)).toBe(
      true
    )
  })
})
