/**
 * Detached sessions on a real VM (QEMU, the Debian cloud kernel, the real guest agent), with the
 * built CLI in real processes: start on a repository whose environment forwards two ports (one
 * taken on the host: told, the start goes on; the other's service, started by the install step,
 * answers on the host with no `abox forward`, and show lists both), exec from three processes at once, a client killed
 * mid-turn (the turn goes on, an attach sees it end), a port forward fetched from the host,
 * then the supervisor SIGKILLed (the VM gone within 3 s, the lock free, start resumes it) and
 * stop. Two boots in all. Skipped with the reason where QEMU or the image tools are missing.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as http from "node:http"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { startCli as startBundle } from "./cliHelpers.js"
import {
  alive,
  ensureTestImage,
  processesMentioning,
  repoRoot,
  testHome,
  vmSkipReason
} from "./e2e-vm-image.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e detached tests skipped: ${skip}`)

const cli = path.join(repoRoot, "dist", "abox.js")
let home = ""
let source = ""
let servicePort = 0
let takenPort = 0

beforeAll(async () => {
  if (skip !== undefined) return
  await ensureTestImage()
  home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-detached-"))
  fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
  source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-src-"))
  fs.writeFileSync(path.join(source, "README.md"), "detached e2e\n")
  // the repository's environment (no setup: the base image itself): its install step starts a
  // service on `servicePort`, which the supervisor forwards with `takenPort` (held on the host)
  servicePort = await freePort()
  takenPort = await freePort()
  fs.mkdirSync(path.join(source, ".abox"))
  fs.writeFileSync(
    path.join(source, ".abox", "environment.json"),
    JSON.stringify({
      base: "abox",
      forward: [servicePort, takenPort],
      install:
        `setsid node -e "require('http').createServer((q, r) => r.end('from the environment ' + q.url)).listen(${servicePort}, '127.0.0.1', () => require('fs').writeFileSync('/tmp/svc-up', ''))" </dev/null >/dev/null 2>&1 & ` +
        "for i in $(seq 1 120); do [ -e /tmp/svc-up ] && break; sleep 1; done"
    })
  )
}, 600_000)
afterAll(() => {
  if (home === "") return
  // never leave a supervisor or a VM behind
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

interface Forwards {
  readonly forwarded: ReadonlyArray<{ guestPort: number; hostPort: number }>
  readonly refused: ReadonlyArray<{ guestPort: number; message: string }>
}

const within = async (ms: number, check: () => boolean) => {
  const deadline = Date.now() + ms
  while (!check() && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50))
  return check()
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

describe.skipIf(skip !== undefined)("detached sessions on a real VM", () => {
  it("start, three execs at once, a client killed mid-turn, forward, SIGKILL of the supervisor, resume, stop", async () => {
    // a host port the environment forwards is taken: told, and the start goes on
    const blocker = net.createServer()
    await new Promise<void>((resolve) => blocker.listen(takenPort, "127.0.0.1", resolve))
    const started = await startCli(["start", source, "--name", "vm", "--json"]).exited
    await new Promise((resolve) => blocker.close(resolve))
    expect(started.code, started.stderr).toBe(0)
    const ready = JSON.parse(started.stdout) as { session: string; pid: number; socket: string; forwards: Forwards }
    const dir = path.join(home, "sessions", ready.session)
    expect(processesMentioning(dir).length).toBeGreaterThan(0) // the VMM helper and QEMU

    // the environment's service answers on the host's loopback with no `abox forward`
    expect(ready.forwards.forwarded).toEqual([{ guestPort: servicePort, hostPort: servicePort }])
    expect(ready.forwards.refused.map((r) => r.guestPort)).toEqual([takenPort])
    expect(ready.forwards.refused[0]!.message).toContain("EADDRINUSE")
    expect(ready.forwards.refused[0]!.message).toContain(`abox forward vm ${takenPort} <another host port>`)
    expect(await fetchText(servicePort)).toBe("from the environment /hello")
    expect(await fetchText(servicePort)).toBe("from the environment /hello")
    const shown = JSON.parse(runCli(["show", "vm", "--json"]).stdout) as { session: { forwards: Forwards } }
    expect(shown.session.forwards).toEqual(ready.forwards)
    expect(runCli(["show", "vm"]).stdout).toMatch(
      new RegExp(`forwards:\\s+127\\.0\\.0\\.1:${servicePort} -> guest ${servicePort}, guest ${takenPort} not forwarded \\(host port refused\\)`)
    )

    // three processes at once: each gets its own output and status; no boot per command
    const three = await Promise.all(
      [1, 2, 3].map(
        (n) => startCli(["exec", "vm", "--", `echo run-${n} >> runs.txt; echo out-${n}; exit ${n}`]).exited
      )
    )
    expect(three.map((r) => [r.code, r.stdout])).toEqual([
      [1, "out-1\n"],
      [2, "out-2\n"],
      [3, "out-3\n"]
    ])
    const uname = runCli(["exec", "vm", "-e", "WHO=guest", "--", "echo $WHO; uname -m; wc -l < runs.txt"])
    expect([uname.code, uname.stdout]).toEqual([0, "guest\nx86_64\n3\n"])

    // a client killed mid-turn: the turn goes on; another client attaches and sees it end
    const doomed = startCli([
      "exec",
      "vm",
      "--",
      "echo begun; sleep 5; echo finished-anyway > after.txt; echo done"
    ])
    await doomed.sees("begun", 120_000)
    doomed.child.kill("SIGKILL")
    const watcher = startCli(["attach", "--watch", "vm"])
    await watcher.seesOnStderr("ended", 120_000)
    watcher.child.kill("SIGTERM")
    const watched = await watcher.exited
    expect(watched.stdout).toContain("done")
    expect(runCli(["exec", "vm", "--", "cat after.txt"]).stdout).toBe("finished-anyway\n")

    // a dev server in the guest, forwarded to the host's loopback and fetched from here
    const server = startCli([
      "exec",
      "vm",
      "--",
      `node -e "require('http').createServer((q, r) => r.end('from the guest ' + q.url)).listen(3000, '127.0.0.1', () => console.log('listening'))"`
    ])
    await server.sees("listening", 120_000)
    const hostPort = await freePort()
    const forward = startCli(["forward", "vm", "3000", String(hostPort)])
    await forward.sees(`forwarding 127.0.0.1:${hostPort}`, 60_000)
    expect(await fetchText(hostPort)).toBe("from the guest /hello")
    expect(await fetchText(hostPort)).toBe("from the guest /hello")
    forward.child.kill("SIGTERM")
    await forward.exited
    server.child.kill("SIGINT") // cancels its turn
    expect((await server.exited).code).toBe(130)

    // list: running, with the supervisor's pid
    const listed = JSON.parse(runCli(["list", "--json"]).stdout) as {
      sessions: Array<{ id: string; supervisor: { pid: number } | null }>
    }
    expect(listed.sessions.find((s) => s.id === ready.session)?.supervisor?.pid).toBe(ready.pid)

    // SIGKILL the supervisor: the VM is gone within 3 s (liveness pipe), the lock is free
    process.kill(ready.pid, "SIGKILL")
    expect(await within(3_000, () => !alive(ready.pid) && processesMentioning(dir).length === 0)).toBe(true)
    expect(runCli(["exec", "vm", "--", "true"]).code).toBe(78) // a stale socket: not running
    const again = runCli(["start", "vm", "--json"])
    expect(again.code, again.stderr).toBe(0)
    const resumed = JSON.parse(again.stdout) as { pid: number; forwards: Forwards }
    // a resumed session forwards the environment's ports again (the taken one is free now)
    expect(resumed.forwards.forwarded.map((f) => f.guestPort)).toEqual([servicePort, takenPort])
    const files = runCli(["exec", "vm", "--", "sort runs.txt; cat after.txt"])
    expect([files.code, files.stdout]).toEqual([0, "run-1\nrun-2\nrun-3\nfinished-anyway\n"])
    const stopped = runCli(["stop", "vm", "--json"])
    expect(stopped.code, stopped.stderr).toBe(0)
    expect(JSON.parse(stopped.stdout)).toEqual({ how: "stopped", pid: resumed.pid })
    expect(processesMentioning(dir)).toEqual([])
    // the forwards went with the session: the host port is free, the listing gone
    expect(fs.existsSync(path.join(dir, "forwards.json"))).toBe(false)
    const reuse = net.createServer()
    await new Promise<void>((resolve, reject) => reuse.once("error", reject).listen(servicePort, "127.0.0.1", resolve))
    await new Promise((resolve) => reuse.close(resolve))
    const meta = JSON.parse(fs.readFileSync(path.join(dir, "session.json"), "utf8")) as {
      lastClose: { how: string }
    }
    expect(meta.lastClose.how).toBe("graceful")
  }, 900_000)
})
