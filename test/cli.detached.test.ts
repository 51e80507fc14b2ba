/**
 * Detached sessions with real processes and FakeVmm (the real guest agent as a host process):
 * the built CLI's start / exec / list / stop, two starts racing, a supervisor SIGKILLed (stale
 * socket, lock free, start again), and the SDK's SessionManager across two processes.
 */
import { describe, expect, it } from "@effect/vitest"
import { spawn, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { cliBundle, runCli, startCli, tempHome, withCliAndSource } from "./cliHelpers.js"

const fake = { ABOX_VMM: "fake", ABOX_SKIP_SCRUB: "1" }
const source = withCliAndSource()
const sdkBundle = path.resolve(import.meta.dirname, "..", "dist", "sdk.js")

const envFor = (home: string) => ({
  PATH: process.env.PATH ?? "",
  HOME: path.join(home, "user"),
  ABOX_HOME: home,
  ABOX_CLI: cliBundle,
  ...fake
})

/** the CLI, asynchronously (several at once) */
const cliAsync = (home: string, args: ReadonlyArray<string>) => startCli(cliBundle, args, envFor(home)).exited

const alive = (pid: number) => {
  try {
    process.kill(pid, 0)
    return true
  } catch {
    return false
  }
}

const within = async (ms: number, check: () => boolean) => {
  const deadline = Date.now() + ms
  while (!check() && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50))
  return check()
}

describe("abox start / exec / list / stop (FakeVmm, real processes)", () => {
  it("start returns when ready; exec from three processes at once; list shows the supervisor; two starts race; stop", async () => {
    const home = tempHome()
    const started = runCli(home, ["start", source(), "--name", "dev", "--json"], fake)
    expect(started.code, started.stderr).toBe(0)
    const ready = JSON.parse(started.stdout) as { session: string; pid: number; socket: string }
    expect(alive(ready.pid)).toBe(true)
    expect(fs.statSync(ready.socket).mode & 0o777).toBe(0o600)

    const three = await Promise.all(
      ["a", "b", "c"].map((word) => cliAsync(home, ["exec", "dev", "--", `echo ${word}; sleep 0.3; exit 7`]))
    )
    expect(three.map((r) => [r.code, r.stdout])).toEqual([
      [7, "a\n"],
      [7, "b\n"],
      [7, "c\n"]
    ])

    const env = runCli(home, ["exec", "dev", "-e", "X=1 2", "-w", "/", "--", "echo $X; pwd"], fake)
    expect([env.code, env.stdout]).toEqual([0, "1 2\n/\n"])
    const timedOut = runCli(home, ["exec", "--timeout", "300ms", "dev", "--", "sleep 20"], fake)
    expect(timedOut.code).toBe(124)

    const listed = JSON.parse(runCli(home, ["list", "--json"], fake).stdout) as {
      sessions: Array<{
        id: string
        supervisor: { pid: number; clients: number; uptimeSeconds: number } | null
      }>
    }
    expect(listed.sessions[0]).toMatchObject({
      id: ready.session,
      supervisor: { pid: ready.pid, clients: 0 }
    })
    expect(runCli(home, ["list"], fake).stdout).toContain(`running: pid ${ready.pid}`)

    // the session is held: another start of it fails at once with SessionBusy
    const again = runCli(home, ["start", "dev"], fake)
    expect(again.code, again.stderr).toBe(75)

    const stopped = runCli(home, ["stop", "dev", "--json"], fake)
    expect(stopped.code, stopped.stderr).toBe(0)
    expect(JSON.parse(stopped.stdout)).toEqual({ how: "stopped", pid: ready.pid })
    expect(alive(ready.pid)).toBe(false)
    expect(fs.existsSync(ready.socket)).toBe(false)
    const gone = runCli(home, ["exec", "dev", "--", "true"], fake)
    expect(gone.code).toBe(78)
    expect(gone.stderr).toContain("not running")

    // two starts of one stopped session race: one wins, the other gets SessionBusy
    const race = await Promise.all([cliAsync(home, ["start", "dev"]), cliAsync(home, ["start", "dev"])])
    expect(race.map((r) => r.code).sort()).toEqual([0, 75])
    expect(runCli(home, ["stop", "dev"], fake).code).toBe(0)
  }, 180_000)

  it("a SIGKILLed supervisor leaves a stale socket: clients are told it is not running, the lock is free, start works again", async () => {
    const home = tempHome()
    const started = runCli(home, ["start", source(), "--name", "k", "--json"], fake)
    expect(started.code, started.stderr).toBe(0)
    const ready = JSON.parse(started.stdout) as { pid: number; socket: string }
    process.kill(ready.pid, "SIGKILL")
    expect(await within(5000, () => !alive(ready.pid))).toBe(true)
    expect(fs.existsSync(ready.socket)).toBe(true)
    const stale = runCli(home, ["exec", "k", "--", "true"], fake)
    expect(stale.code, stale.stderr).toBe(78)
    // the lock died with it (the fake guest may take a moment to notice its host is gone)
    let restarted = runCli(home, ["start", "k", "--json"], fake)
    for (let i = 0; i < 20 && restarted.code === 75; i++) {
      await new Promise((r) => setTimeout(r, 250))
      restarted = runCli(home, ["start", "k", "--json"], fake)
    }
    expect(restarted.code, restarted.stderr).toBe(0)
    const out = runCli(home, ["exec", "k", "--", "cat README.md"], fake)
    expect([out.code, out.stdout]).toEqual([0, "hello\n"])
    expect(runCli(home, ["stop", "k"], fake).code).toBe(0)
  }, 180_000)

  it("diff, apply and cp (both ways) on a running session go through its supervisor: no boot, no SessionBusy", async () => {
    const home = tempHome()
    expect(runCli(home, ["start", source(), "--name", "rp"], fake).code).toBe(0)
    try {
      const changed = runCli(
        home,
        ["exec", "rp", "--", "echo changed >> README.md; echo new > new.txt"],
        fake
      )
      expect(changed.code).toBe(0)
      const diff = runCli(home, ["diff", "rp"], fake)
      expect(diff.stderr).toBe("")
      expect(diff.code).toBe(0)
      expect(diff.stdout).toContain("+changed")
      expect(diff.stdout).toContain("b/new.txt")
      expect(runCli(home, ["diff", "rp", "--stat"], fake).stdout).toContain("new.txt")

      // cp out: a relative host path is the client's (resolved here, written by the supervisor)
      const work = tempHome()
      const out = spawnSync(process.execPath, [cliBundle, "cp", "rp:new.txt", "got.txt"], {
        cwd: work,
        env: envFor(home),
        encoding: "utf8"
      })
      expect(out.status, out.stderr).toBe(0)
      expect(fs.readFileSync(path.join(work, "got.txt"), "utf8")).toBe("new\n")
      // an existing destination is refused, nothing written (RepoPathInvalid, 82)
      const again = runCli(home, ["cp", "rp:README.md", path.join(work, "got.txt")], fake)
      expect(again.code).toBe(82)
      expect(fs.readFileSync(path.join(work, "got.txt"), "utf8")).toBe("new\n")

      // cp in: a host file into the session
      fs.writeFileSync(path.join(work, "in.txt"), "from the host\n")
      expect(runCli(home, ["cp", path.join(work, "in.txt"), "rp:"], fake).code).toBe(0)
      expect(runCli(home, ["exec", "rp", "--", "cat in.txt"], fake).stdout).toBe("from the host\n")

      // apply to a copy of the source; a source changed where the patch writes is refused (SourceChanged, 97)
      const target = tempHome()
      fs.writeFileSync(path.join(target, "README.md"), "hello\n")
      const applied = runCli(home, ["apply", "rp", "--to", target, "--json"], fake)
      expect(applied.code, applied.stderr).toBe(0)
      expect(JSON.parse(applied.stdout)).toMatchObject({
        applied: true,
        paths: ["README.md", "in.txt", "new.txt"]
      })
      expect(fs.readFileSync(path.join(target, "README.md"), "utf8")).toBe("hello\nchanged\n")
      const clash = tempHome()
      fs.writeFileSync(path.join(clash, "README.md"), "mine\n")
      const refused = runCli(home, ["apply", "rp", "--to", clash], fake)
      expect(refused.code).toBe(97)
      expect(refused.stderr).toContain("changed since the snapshot where the patch writes: README.md")
      expect(fs.readFileSync(path.join(clash, "README.md"), "utf8")).toBe("mine\n")
    } finally {
      expect(runCli(home, ["stop", "rp"], fake).code).toBe(0)
    }
  }, 180_000)

  it.skipIf(!fs.existsSync(sdkBundle))(
    "SessionManager across processes: one starts detached and exits, another connects by name, runs, lists, stops",
    async () => {
      const home = tempHome()
      const script = (body: string) => {
        const r = spawnSync(
          process.execPath,
          [
            "--input-type=module",
            "-e",
            `import { SessionManager, dispose } from ${JSON.stringify(sdkBundle)};\nconst m = new SessionManager();\n${body}\nawait dispose();`
          ],
          {
            env: envFor(home),
            encoding: "utf8",
            timeout: 120_000
          }
        )
        return { code: r.status, stdout: r.stdout, stderr: r.stderr }
      }
      const first = script(
        `const s = await m.start("shared", { source: ${JSON.stringify(source())}, detached: true });\nconsole.log(JSON.stringify({ id: s.id, out: (await s.run("echo from-first")).stdout }));\nawait s.close();`
      )
      expect(first.code, first.stderr).toBe(0)
      const { id, out } = JSON.parse(first.stdout) as { id: string; out: string }
      expect(out).toBe("from-first\n")
      const second = script(
        `const s = await m.connect("shared");\nconst r = await s.run("cat README.md; exit 4");\nconst p = await s.run("say hi", { mode: "prompt" });\nawait s.run("echo sdk > sdk.txt");\nconst d = await s.diff({ stat: true });\nconst out = ${JSON.stringify(path.join(home, "sdk-out.txt"))};\nawait s.files.copyOut("sdk.txt", out);\nconst copied = (await import("node:fs")).readFileSync(out, "utf8");\nawait s.files.write("bin/tool", new Uint8Array([0, 255, 10]), 0o755);\nconst rw = { read: Array.from(await s.files.read("bin/tool")), list: await s.files.list("bin"), outside: await s.files.read("../x").then(() => "read", (e) => e._tag) };\nconst listed = await m.list();\nconsole.log(JSON.stringify({ id: s.id, r: [r.exitCode, r.stdout], p: p.agentEnd, d: d.includes("sdk.txt"), copied, rw, listed: listed.map((n) => [n.name, n.running, typeof n.supervisorPid]) , stopped: await m.stop("shared") }));\nconsole.log(JSON.stringify(await m.list()));`
      )
      expect(second.code, second.stderr).toBe(0)
      const [line1, line2] = second.stdout.trim().split("\n")
      expect(JSON.parse(line1!)).toEqual({
        id,
        r: [4, "hello\n"],
        // a prompt turn over the socket reaches the model agent (no key here: it ends saying so)
        p: {
          kind: "agent_end",
          reason: "error",
          steps: 1,
          message: expect.stringContaining("set ANTHROPIC_API_KEY on the host")
        },
        // diff and files.copyOut over the socket (no ControlRefused)
        d: true,
        copied: "sdk\n",
        // files.write/read/list over the socket: bytes, mode, entries; a path outside stays typed
        rw: {
          read: [0, 255, 10],
          list: [{ path: "bin/tool", type: "file", size: 3, mode: 0o755 }],
          outside: "RepoPathInvalid"
        },
        listed: [["shared", true, "number"]],
        stopped: true
      })
      expect(JSON.parse(line2!)).toMatchObject([{ name: "shared", running: false }])
    },
    180_000
  )

  it("the supervisor's log gets its lines; its environment is inherited, never on its command line", async () => {
    const home = tempHome()
    const canary = "canary-secret-9d2e"
    const child = spawn(process.execPath, [cliBundle, "start", source(), "--name", "env", "--json"], {
      env: { ...envFor(home), ANTHROPIC_API_KEY: canary },
      stdio: ["ignore", "pipe", "pipe"]
    })
    let stdout = ""
    child.stdout.on("data", (d: Buffer) => (stdout += d.toString()))
    const code = await new Promise<number | null>((resolve) => child.on("exit", (c) => resolve(c)))
    expect(code).toBe(0)
    const { pid } = JSON.parse(stdout) as { pid: number }
    const cmdline = fs.readFileSync(`/proc/${pid}/cmdline`, "utf8")
    expect(cmdline).toContain("supervise")
    expect(cmdline).not.toContain(canary)
    expect(fs.readFileSync(path.join(home, "supervisor.log"), "utf8")).toContain(`(pid ${pid})`)
    expect(runCli(home, ["stop", "env"], fake).code).toBe(0)
    for (const file of fs.readdirSync(path.join(home, "sessions"), { recursive: true }) as Array<string>) {
      const full = path.join(home, "sessions", file)
      if (fs.statSync(full).isFile()) expect(fs.readFileSync(full, "latin1")).not.toContain(canary)
    }
  }, 180_000)
})
