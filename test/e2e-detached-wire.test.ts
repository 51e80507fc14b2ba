/**
 * A detached session on a real VM (QEMU, the busybox test image, the real guest agent) and a
 * real supervisor process (`abox start`), seen from its control socket and its directory: the
 * SDK's `SessionManager.connect(...).run()` gets a turn's exact bytes over the socket (300,000
 * random ones, a leading BOM, stderr); a flood of newlines after a request closes that connection,
 * and a flood of requests costs the supervisor no memory; every file of the session has the mode that
 * docs/on-disk.md gives it, while it runs and after it stopped. One boot.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import { spawnSync } from "node:child_process"
import * as crypto from "node:crypto"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { ensureTestImage, processesMentioning, repoRoot, testHome, vmSkipReason } from "./e2e-vm-image.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e detached wire tests skipped: ${skip}`)

// the SDK reads ABOX_HOME through Config: set before its runtime is made
const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-wire-"))
process.env.ABOX_HOME = home
const sdk = await import("../src/sdk/index.js")

const cli = path.join(repoRoot, "dist", "abox.js")
const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-wire-src-"))
const random = crypto.randomBytes(300_000)

beforeAll(async () => {
  if (skip !== undefined) return
  await ensureTestImage()
  fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
  fs.writeFileSync(path.join(source, "random.bin"), random)
}, 600_000)
afterAll(async () => {
  await sdk.dispose()
  // the VM names the home in its argv, the supervisor only the source
  for (const pid of [...processesMentioning(home), ...processesMentioning(source)]) {
    try {
      process.kill(pid, "SIGKILL")
    } catch {
      // gone
    }
  }
  fs.rmSync(home, { recursive: true, force: true })
  fs.rmSync(source, { recursive: true, force: true })
})

const runCli = (args: ReadonlyArray<string>) => {
  const r = spawnSync(process.execPath, [cli, ...args], {
    env: { PATH: process.env.PATH ?? "", HOME: os.homedir(), ABOX_HOME: home },
    encoding: "utf8",
    timeout: 300_000
  })
  return { code: r.status, stdout: r.stdout, stderr: r.stderr }
}

/** the supervisor's resident memory, in bytes */
const rss = (pid: number): number => {
  const line = fs
    .readFileSync(`/proc/${pid}/status`, "utf8")
    .split("\n")
    .find((l) => l.startsWith("VmRSS:"))
  return Number(/(\d+)/.exec(line ?? "")?.[1] ?? "0") * 1024
}

/**
 * Sends `request`, then newline chunks of `chunk` as fast as the socket takes them for at most
 * `ms`; what the supervisor answered, and whether it closed the connection before the time was up
 */
const flood = (socketPath: string, request: string, chunk: Buffer, ms: number) =>
  new Promise<{ replies: Array<Record<string, unknown>>; closedEarly: boolean; sent: number }>((resolve) => {
    const socket = net.connect(socketPath)
    let got = ""
    let sent = 0
    let done = false
    const finish = (closedEarly: boolean) => {
      if (done) return
      done = true
      clearTimeout(timer)
      socket.destroy()
      const replies = got
        .split("\n")
        .filter((l) => l !== "")
        .map((l) => JSON.parse(l) as Record<string, unknown>)
      resolve({ replies, closedEarly, sent })
    }
    const timer = setTimeout(() => finish(false), ms)
    socket.on("data", (d: Buffer) => (got += d.toString("utf8")))
    socket.on("close", () => finish(true))
    socket.on("error", () => undefined)
    const pump = () => {
      while (!done && !socket.destroyed) {
        sent += chunk.length
        if (!socket.write(chunk)) return void socket.once("drain", pump)
      }
    }
    socket.once("connect", () => {
      socket.write(request + "\n")
      pump()
    })
  })

/** the modes docs/on-disk.md gives the files of a session ("Files of a session") */
const documentedModes = (): Map<string, number> => {
  const doc = fs.readFileSync(path.join(repoRoot, "docs", "on-disk.md"), "utf8")
  const section = doc.slice(
    doc.indexOf("## Files of a session"),
    doc.indexOf("A session directory is created whole")
  )
  const modes = new Map<string, number>()
  for (const line of section.split("\n")) {
    const cells = line.split("|").map((c) => c.trim())
    const mode = cells.at(-2) ?? ""
    if (!/^0[0-7]{3}$/.test(mode)) continue
    for (const [, name] of (cells[1] ?? "").matchAll(/`([^`]+)`/g)) modes.set(name!, Number.parseInt(mode, 8))
  }
  return modes
}

/** every entry of the session directory whose mode is not the documented one (or that is not documented) */
const modeProblems = (dir: string): Array<string> => {
  const modes = documentedModes()
  const problems: Array<string> = []
  const dirMode = fs.statSync(dir).mode & 0o777
  if (dirMode !== 0o700) problems.push(`${dir}: ${dirMode.toString(8)}, not 700`)
  for (const name of fs.readdirSync(dir)) {
    const mode = fs.lstatSync(path.join(dir, name)).mode & 0o777
    const expected = modes.get(name)
    if (expected === undefined) problems.push(`${name}: not in docs/on-disk.md`)
    else if (mode !== expected)
      problems.push(`${name}: ${mode.toString(8)}, docs/on-disk.md says ${expected.toString(8)}`)
  }
  return problems
}

describe.skipIf(skip !== undefined)("a detached session's wire and files on a real VM", () => {
  it("exact bytes through SessionManager.connect().run(); a newline flood refused; every file's mode as documented", async () => {
    const started = runCli(["start", source, "--name", "wire", "--json"])
    expect(started.code, started.stderr).toBe(0)
    const ready = JSON.parse(started.stdout) as { session: string; pid: number; socket: string }
    const dir = path.join(home, "sessions", ready.session)
    expect(documentedModes().get("qmp.sock")).toBe(0o600)

    // the SDK, through the supervisor: the bytes the turn wrote, exactly
    const manager = new sdk.SessionManager()
    const session = await manager.connect("wire")
    const abc = await session.run("printf abc")
    expect([abc.exitCode, Buffer.from(abc.stdoutBytes).toString("latin1")]).toEqual([0, "abc"])
    const bom = await session.run("printf '\\357\\273\\277bom\\n'")
    expect(Buffer.from(bom.stdoutBytes).toString("hex")).toBe(Buffer.from("\ufeffbom\n").toString("hex"))
    const bytes = await session.run("cat random.bin; cat random.bin >&2")
    expect(bytes.exitCode).toBe(0)
    expect(bytes.stdoutBytes.length).toBe(random.length)
    expect(Buffer.compare(Buffer.from(bytes.stdoutBytes), random)).toBe(0)
    expect(Buffer.compare(Buffer.from(bytes.stderrBytes), random)).toBe(0)
    await session.close()

    // while it runs: the sockets and disks are the owner's alone
    expect(modeProblems(dir)).toEqual([])

    // a flood of newlines after the handshake and a Turn request: the connection is closed at
    // the first one (not a reply per line); the turn it asked for goes on without it
    const hello = JSON.stringify({ type: "hello", version: 2 })
    const request = (id: number, tag: string, payload: unknown) =>
      JSON.stringify({ _tag: "Request", id: String(id), tag, payload, headers: [] })
    const newlines = Buffer.alloc(64 * 1024, 10)
    const refused = await flood(
      ready.socket,
      `${hello}\n${request(1, "Turn", { text: "sleep 5" })}`,
      newlines,
      20_000
    )
    expect(refused.closedEarly).toBe(true)
    expect(refused.replies[0]).toEqual({ type: "welcome", version: 2 })
    expect(refused.replies.some((r) => JSON.stringify(r).includes('"Ended"'))).toBe(false)
    // valid requests the supervisor only answers (a Resize with no terminal turn), 16 s of them:
    // what it holds stops growing once the garbage collector has found its level (sampled each
    // second)
    const samples: Array<number> = []
    const sampler = setInterval(() => samples.push(rss(ready.pid)), 1000)
    const resize = Buffer.from(
      Array.from({ length: 2048 }, (_, i) => `${request(10 + i, "Resize", { rows: 1, cols: 1 })}\n`).join("")
    )
    const ignored = await flood(
      ready.socket,
      `${hello}\n${request(2, "Turn", { text: "sleep 25" })}`,
      resize,
      16_000
    )
    clearInterval(sampler)
    expect(ignored.closedEarly).toBe(false)
    // past the sockets' buffers: the client waited at the pace the supervisor handled them
    expect(ignored.sent).toBeGreaterThan(3 * 1024 * 1024)
    // what it keeps is the level its garbage collections come back to (the lows): a request
    // held past its answer raises it second by second; the peaks between collections swing
    // with the request rate (tens of MiB on the RPC wire), so they are only bounded loosely
    const shown = `RSS each second: ${samples.map((b) => Math.round(b / 2 ** 20)).join(" ")} MiB; ${ignored.sent} bytes sent`
    const [early, late] = [samples.slice(0, 8), samples.slice(8)]
    expect(Math.min(...late) - Math.min(...early), shown).toBeLessThan(24 * 1024 * 1024)
    expect(Math.max(...late) - Math.max(...early), shown).toBeLessThan(64 * 1024 * 1024)
    // the supervisor still serves
    expect(runCli(["exec", "wire", "--", "echo still"]).stdout).toBe("still\n")

    const stopped = runCli(["stop", "wire"])
    expect(stopped.code, stopped.stderr).toBe(0)
    expect(modeProblems(dir)).toEqual([])
  }, 600_000)
})
