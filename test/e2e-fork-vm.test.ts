/**
 * Fork on a real VM (QEMU under TCG, the busybox test image, the built CLI in real processes):
 * a detached session's dev server, started by a turn, answers through `abox forward` after
 * `suspend` + `start`; `abox fork` of the running session gives a second session with the same
 * files and the same server, whose /dev/urandom output and broker CA differ from the parent's;
 * both go on independently; a fork of the (stopped) fork works; `rm` of the parent is refused
 * (SessionHasForks, exit 114) and `--force` makes the forks independent, which still boot.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as http from "node:http"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { startCli as startBundle } from "./cliHelpers.js"
import { ensureTestImage, processesMentioning, repoRoot, testHome, vmSkipReason } from "./e2e-vm-image.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e-fork-vm: skipped: ${skip}`)

const cli = path.join(repoRoot, "dist", "abox.js")
let home = ""
let source = ""

beforeAll(async () => {
  if (skip !== undefined) return
  await ensureTestImage()
  home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-fork-"))
  fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
  source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-fork-src-"))
  fs.writeFileSync(path.join(source, "README.md"), "fork e2e\n")
}, 600_000)
afterAll(() => {
  if (home === "") return
  for (const pid of processesMentioning(home)) {
    try {
      process.kill(pid, "SIGKILL")
    } catch {
      // gone
    }
  }
  fs.rmSync(home, { recursive: true, force: true })
  fs.rmSync(source, { recursive: true, force: true })
})

const env = () => ({ PATH: process.env.PATH ?? "", HOME: os.homedir(), ABOX_HOME: home })
const runCli = (args: ReadonlyArray<string>) => {
  const r = spawnSync(process.execPath, [cli, ...args], { env: env(), encoding: "utf8", timeout: 300_000 })
  return { code: r.status, stdout: r.stdout, stderr: r.stderr }
}
const startCli = (args: ReadonlyArray<string>) => startBundle(cli, args, env())
const exec = (ref: string, command: string) => {
  const r = runCli(["exec", ref, "--", command])
  expect(r.code, `${ref}: ${command}: ${r.stderr}`).toBe(0)
  return r.stdout
}

const freePort = () =>
  new Promise<number>((resolve) => {
    const probe = net.createServer().listen(0, "127.0.0.1", () => {
      const port = (probe.address() as net.AddressInfo).port
      probe.close(() => resolve(port))
    })
  })

const fetchText = (port: number) =>
  new Promise<string>((resolve, reject) => {
    http
      .get({ host: "127.0.0.1", port, path: "/hello", timeout: 60_000 }, (res) => {
        let body = ""
        res.on("data", (d: Buffer) => (body += d.toString()))
        res.on("end", () => resolve(body))
      })
      .on("error", reject)
  })

/** the guest's port 3000 through `abox forward`, fetched once */
const fetchThroughForward = async (ref: string) => {
  const hostPort = await freePort()
  const forward = startCli(["forward", ref, "3000", String(hostPort)])
  await forward.sees(`forwarding 127.0.0.1:${hostPort}`, 60_000)
  try {
    return await fetchText(hostPort)
  } finally {
    forward.child.kill("SIGTERM")
    await forward.exited
  }
}

// a server that outlives the turn that started it, and says which process it is
const SERVER =
  `setsid node -e "require('http').createServer((q, r) => r.end('pid ' + process.pid + ' ' + q.url)).listen(3000, '127.0.0.1')" </dev/null >/dev/null 2>&1 & ` +
  "sleep 2; echo $! > /tmp/server.pid"

const sessionJson = (id: string) =>
  JSON.parse(fs.readFileSync(path.join(home, "sessions", id, "session.json"), "utf8")) as {
    id: string
    name?: string
    fork?: { parent: string; from: string; root: string }
  }

describe.skipIf(skip !== undefined)("fork on a real VM", () => {
  it("a server survives suspend + start; fork of the running session: same files and server, other entropy and CA, independent; fork of a fork; rm refused, --force", async () => {
    const started = runCli(["start", source, "--name", "p", "--memory", "512", "--json"])
    expect(started.code, started.stderr).toBe(0)
    const parentId = (JSON.parse(started.stdout) as { session: string }).session
    exec("p", SERVER)
    exec("p", "echo from-parent > shared.txt; sync")
    const served = await fetchThroughForward("p")
    expect(served).toMatch(/^pid \d+ \/hello$/)

    // suspend + start: the same server process answers
    expect(runCli(["suspend", "p"]).code).toBe(0)
    const restarted = runCli(["start", "p", "--json"])
    expect(restarted.code, restarted.stderr).toBe(0)
    expect(await fetchThroughForward("p")).toBe(served)

    // fork of the running parent
    const forked = runCli(["fork", "p", "--name", "c", "--json"])
    expect(forked.code, forked.stderr).toBe(0)
    const child = (JSON.parse(forked.stdout) as { session: { id: string } }).session
    expect(sessionJson(child.id).fork).toMatchObject({ parent: parentId, from: "running" })
    expect(runCli(["fork", "p", "--name", "c"]).code).toBe(69) // NameTaken: the name is c's
    const childStart = runCli(["start", "c", "--json"])
    expect(childStart.code, childStart.stderr).toBe(0)
    expect(exec("c", "cat shared.txt")).toBe("from-parent\n")
    // the same process (pid and all) answers in the fork
    expect(await fetchThroughForward("c")).toBe(served)
    expect(await fetchThroughForward("p")).toBe(served)

    // other entropy, other broker CA (the fork's own, from this host's guest-config.json)
    const random = (ref: string) => exec(ref, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
    expect(random("c")).not.toBe(random("p"))
    const caOf = (ref: string) => exec(ref, "cat /run/abox/session-ca.pem")
    const parentCa = caOf("p")
    const childCa = caOf("c")
    expect(childCa).not.toBe(parentCa)
    const childConfig = JSON.parse(
      fs.readFileSync(path.join(home, "sessions", child.id, "guest-config.json"), "utf8")
    ) as { brokerCaCert: string; sessionId: string }
    expect(childCa.trim()).toBe(childConfig.brokerCaCert.trim())
    expect(childConfig.sessionId).toBe(child.id)

    // independent from here
    exec("p", "echo p > only-p.txt")
    exec("c", "echo c > only-c.txt")
    expect(exec("c", "ls only-p.txt 2>/dev/null || echo absent")).toBe("absent\n")
    expect(exec("p", "ls only-c.txt 2>/dev/null || echo absent")).toBe("absent\n")

    expect(runCli(["stop", "c"]).code).toBe(0)
    expect(runCli(["stop", "p"]).code).toBe(0)

    // a fork of the stopped fork: its disks as they were, a cold boot
    const grand = runCli(["fork", "c", "--name", "g", "--json"])
    expect(grand.code, grand.stderr).toBe(0)
    const grandId = (JSON.parse(grand.stdout) as { session: { id: string } }).session.id
    expect(sessionJson(grandId).fork).toMatchObject({ parent: child.id, from: "stopped" })

    // rm of the parent: refused, naming its forks; nothing removed
    const refused = runCli(["rm", "p", "--yes"])
    expect(refused.code).toBe(114)
    expect(refused.stderr).toContain(child.id)
    expect(refused.stderr).toContain(grandId)
    expect(fs.existsSync(path.join(home, "sessions", parentId))).toBe(true)
    const listed = runCli(["list"])
    expect(listed.stdout).toContain("fork of p")

    const removed = runCli(["rm", "p", "--yes", "--force"])
    expect(removed.code, removed.stderr).toBe(0)
    expect(fs.existsSync(path.join(home, "sessions", parentId))).toBe(false)
    for (const ref of ["c", "g"]) {
      const again = runCli(["start", ref, "--json"])
      expect(again.code, again.stderr).toBe(0)
      expect(exec(ref, "cat shared.txt; cat only-c.txt")).toBe("from-parent\nc\n")
      expect(runCli(["stop", ref]).code).toBe(0)
    }
    expect(processesMentioning(home)).toEqual([])
  }, 900_000)
})
