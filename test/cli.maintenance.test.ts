/**
 * `abox gc`, `abox logs` and `abox doctor` through the built CLI, with real processes and a
 * real lock: gc cleans only what a crash leaves (never a session, never a running one's files).
 */
import { describe, expect, it } from "@effect/vitest"
import { spawn, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { cliBundle, runCli, startCli, tempHome, withCliAndSource } from "./cliHelpers.js"
import { alive } from "./support/processes.js"
import { stagingPath } from "../src/lib/staging.js"

const fake = { ABOX_VMM: "fake" }
const sourceDir = withCliAndSource()

const newSession = (home: string, name?: string) => {
  const r = runCli(
    home,
    ["run", "--json", ...(name ? ["--name", name] : []), sourceDir(), "--", "echo", "hi"],
    fake
  )
  expect(r.code, r.stderr).toBe(0)
  return (JSON.parse(r.stdout.split("\n")[0]!) as { session: string }).session
}

describe("abox gc", () => {
  it("removes stale sockets, temp files and dangling names; --dry-run changes nothing; sessions stay", () => {
    const home = tempHome()
    const id = newSession(home)
    const gone = newSession(home, "orphan-name")
    const dir = path.join(home, "sessions", id)
    fs.writeFileSync(path.join(dir, "rpc.sock"), "")
    fs.writeFileSync(path.join(dir, ".session.json.tmp-abc123"), "{}")
    fs.rmSync(path.join(home, "sessions", gone), { recursive: true })

    const dry = runCli(home, ["gc", "--dry-run", "--json"], fake)
    expect(dry.code).toBe(0)
    const planned = (JSON.parse(dry.stdout) as { actions: Array<{ kind: string; done: boolean }> }).actions
    expect(planned.map((a) => a.kind).sort()).toEqual(["dangling-name", "socket", "temp-file"])
    expect(planned.every((a) => !a.done)).toBe(true)
    expect(fs.existsSync(path.join(dir, "rpc.sock"))).toBe(true)

    const real = runCli(home, ["gc", "--json"], fake)
    expect(real.code).toBe(0)
    expect(fs.existsSync(path.join(dir, "rpc.sock"))).toBe(false)
    expect(fs.existsSync(path.join(dir, ".session.json.tmp-abc123"))).toBe(false)
    expect(fs.existsSync(path.join(dir, "session.json"))).toBe(true)
    expect(runCli(home, ["show", "orphan-name"], fake).code).toBe(65)
    expect(runCli(home, ["gc"], fake).stdout).toContain("nothing to clean")
  })

  it("removes the staging directories of interrupted image imports and builds, not one being written", () => {
    const home = tempHome()
    const images = path.join(home, "images")
    fs.mkdirSync(images, { recursive: true })
    // a process that has ended: its staging directories are an interrupted import's
    const dead = spawnSync(process.execPath, ["-e", ""]).pid!
    const stale = [`.import-${dead}-0123456789ab`, `.import-work-${dead}-0123456789ab`, ".import-a1b2c3d4e5f6"]
    for (const name of stale) fs.mkdirSync(path.join(images, name, "layers"), { recursive: true })
    // named before the pid was in the name: removed once a day old
    const old = new Date(Date.now() - 2 * 24 * 3600 * 1000)
    fs.utimesSync(path.join(images, ".import-a1b2c3d4e5f6"), old, old)
    // being written now: this process's, and a fresh one of the older naming
    const live = stagingPath(images, "env-0123456789abcdef")
    fs.mkdirSync(live)
    fs.mkdirSync(path.join(images, ".build-ffffffffffff"))
    fs.mkdirSync(path.join(images, "abox"))

    const dry = runCli(home, ["gc", "--dry-run", "--json"], fake)
    const planned = (JSON.parse(dry.stdout) as { actions: Array<{ kind: string; target: string }> }).actions
    expect(planned.filter((a) => a.kind === "image-staging").map((a) => path.basename(a.target)).sort()).toEqual(
      [...stale].sort()
    )
    expect(runCli(home, ["gc"], fake).code).toBe(0)
    expect(fs.readdirSync(images).sort()).toEqual([".build-ffffffffffff", path.basename(live), "abox"].sort())
  })

  it("leaves a running session's socket alone", async () => {
    const home = tempHome()
    const id = newSession(home)
    const holder = startCli(cliBundle, ["resume", id, "--", "echo running; sleep 3"], {
      PATH: process.env.PATH ?? "",
      HOME: path.join(home, "user"),
      ABOX_HOME: home,
      ...fake
    })
    await holder.sees("running")
    const r = runCli(home, ["gc", "--json"], fake)
    expect((JSON.parse(r.stdout) as { actions: Array<unknown> }).actions).toEqual([])
    expect(fs.existsSync(path.join(home, "sessions", id, "rpc.sock"))).toBe(true)
    expect((await holder.exited).code).toBe(0)
  })

  it("stops a VMM whose session directory is gone, after checking its command line is ours", async () => {
    const home = tempHome()
    // a stand-in VMM: argv[0] is qemu's name, its disk argument is under our sessions dir
    const disk = path.join(home, "sessions", "01deadsession0000000000000", "root.raw")
    const vmm = spawn(
      process.execPath,
      ["-e", "setInterval(() => {}, 1000)", "--", "-drive", `file=${disk},format=raw`],
      {
        argv0: "qemu-system-x86_64",
        stdio: "ignore"
      }
    )
    // and one that is not ours (another home): never touched
    const other = spawn(
      process.execPath,
      ["-e", "setInterval(() => {}, 1000)", "--", "-drive", "file=/elsewhere/sessions/x/root.raw"],
      {
        argv0: "qemu-system-x86_64",
        stdio: "ignore"
      }
    )
    try {
      await new Promise((r) => setTimeout(r, 300))
      const dry = runCli(home, ["gc", "--dry-run", "--json"], fake)
      const planned = (JSON.parse(dry.stdout) as { actions: Array<{ kind: string; target: string }> }).actions
      expect(planned).toEqual([
        expect.objectContaining({ kind: "orphan-vmm", target: expect.stringContaining(String(vmm.pid)) })
      ])
      expect(alive(vmm.pid!)).toBe(true)
      runCli(home, ["gc"], fake)
      await new Promise((r) => vmm.once("exit", r))
      expect(alive(vmm.pid!)).toBe(false)
      expect(alive(other.pid!)).toBe(true)
    } finally {
      vmm.kill("SIGKILL")
      other.kill("SIGKILL")
    }
  })
})

describe("abox logs and doctor", () => {
  it("logs prints the guest console; --broker the broker's decisions; a never-booted session says so", () => {
    const home = tempHome()
    const id = newSession(home)
    const log = runCli(home, ["logs", id], fake)
    expect(log.code).toBe(0)
    expect(log.stdout).toContain("abox-guest")
    expect(runCli(home, ["logs", id, "--broker"], fake).stdout).toContain("no broker decisions yet")
    fs.rmSync(path.join(home, "sessions", id, "console.log"))
    expect(runCli(home, ["logs", id], fake).stderr).toContain("no console log yet")
  })

  it("doctor --json lists its checks and fails (exit 1) without an image", () => {
    const home = tempHome()
    const r = runCli(home, ["doctor", "--json"])
    const checks = (JSON.parse(r.stdout) as { checks: Array<{ name: string; status: string }> }).checks
    expect(checks.map((c) => c.name)).toEqual(
      expect.arrayContaining(["node", "vmm", "image", "disk", "scrubber"])
    )
    expect(checks.find((c) => c.name === "image")?.status).toBe("fail")
    expect(r.code).toBe(1)
  })
})
