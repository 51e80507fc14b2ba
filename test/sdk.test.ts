import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"

// The SDK reads ABOX_HOME and ABOX_VMM through Config: set them before the runtime is made.
const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-sdk-"))
const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-sdk-src-"))
process.env.ABOX_HOME = home
process.env.ABOX_VMM = "fake"

const sdk = await import("../src/sdk/index.js")
const { processesMentioning } = await import("./support/processes.js")

beforeAll(() => {
  fs.writeFileSync(path.join(source, "hello.txt"), "hello from the host\n")
})
afterAll(async () => {
  await sdk.dispose()
  fs.rmSync(home, { recursive: true, force: true })
  fs.rmSync(source, { recursive: true, force: true })
})

describe("SDK (Promise facade) over the fake backend", () => {
  it("opens, streams a turn, closes with await using; the session stays on disk", async () => {
    let id = ""
    {
      await using session = await sdk.open({ source })
      id = session.id
      const kinds: Array<string> = []
      for await (const event of session.turn("cat hello.txt; echo err >&2"))
        kinds.push(event._tag === "End" ? "End" : event.event.kind)
      expect(kinds.at(-1)).toBe("End")
      expect(kinds).toContain("stdout")
      const outcome = await session.run("exit 7")
      expect(outcome.exitCode).toBe(7)
    }
    const rows = await sdk.list()
    const row = rows.find((r) => r.id === id)
    expect(row?._tag).toBe("Ok")
    expect(row?._tag === "Ok" ? row.meta.lastClose?.how : undefined).toBe("graceful")
    expect(fs.existsSync(path.join(home, "sessions", id, "transcript.json"))).toBe(false)
  })

  it("the phases of Open as events (a plain callback)", async () => {
    const phases: Array<string> = []
    const session = await sdk.open({ source, onPhase: (phase) => void phases.push(phase) })
    await session.close()
    expect(phases).toEqual(["snapshot", "clone", "config", "boot", "transfer", "ready"])
  })

  it("session.diff, files.read/write/list, apply; a stopped session's diff boots it; typed errors", async () => {
    let id = ""
    {
      await using session = await sdk.open({ source })
      id = session.id
      await session.files.write("notes/new.txt", "written by the SDK\n")
      expect(Buffer.from(await session.files.read("notes/new.txt")).toString()).toBe("written by the SDK\n")
      expect((await session.files.list("notes")).map((e) => e.path)).toEqual(["notes/new.txt"])
      await session.run("printf 'changed\\n' > hello.txt")
      const patch = await session.diff()
      expect(patch).toContain("diff --git a/hello.txt b/hello.txt")
      expect(patch).toContain("+written by the SDK")
      const error = await session.files.read("../outside").then(
        () => undefined,
        (e: unknown) => e
      )
      expect(error).toBeInstanceOf(sdk.RepoPathInvalid)
      const target = fs.mkdtempSync(path.join(os.tmpdir(), "abox-sdk-apply-"))
      fs.cpSync(source, target, { recursive: true })
      expect(await session.apply({ to: target })).toEqual(["hello.txt", "notes/new.txt"])
      expect(fs.readFileSync(path.join(target, "hello.txt"), "utf8")).toBe("changed\n")
    }
    expect(await sdk.diff(id, { stat: true })).toContain("hello.txt")
  })

  it("leaving a turn early cancels it, and the session goes on", async () => {
    const session = await sdk.open({ source })
    try {
      const started = Date.now()
      for await (const event of session.turn("echo start; sleep 30; echo never")) {
        if (event._tag === "Event") break
      }
      const next = await session.run("echo after")
      expect(next.stdout).toBe("after\n")
      expect(Date.now() - started).toBeLessThan(20_000)
    } finally {
      await session.close()
    }
  })

  it("remove refuses an open session (SessionBusy, nothing deleted), then removes it once closed", async () => {
    const session = await sdk.open({ source })
    try {
      await expect(sdk.remove(session.id)).rejects.toMatchObject({ _tag: "SessionBusy" })
      expect(fs.existsSync(path.join(home, "sessions", session.id, "session.json"))).toBe(true)
      expect((await session.run("echo still here")).stdout).toBe("still here\n")
    } finally {
      await session.close()
    }
    await sdk.remove(session.id)
    expect(fs.existsSync(path.join(home, "sessions", session.id))).toBe(false)
  })

  it("rejects with the typed error itself", async () => {
    await expect(sdk.resume("no-such-session")).rejects.toMatchObject({ _tag: "SessionNotFound" })
    await expect(sdk.open({ source: path.join(source, "missing") })).rejects.toMatchObject({
      _tag: "SourceInvalid"
    })
  })

  it("SessionManager: start, connect, list, stop by name (seed 001)", async () => {
    const manager = new sdk.SessionManager()
    const started = await manager.start("my-project", { source })
    await started.run("echo remembered > note.txt")
    expect(await manager.connect("my-project")).toBe(started)
    expect((await manager.list()).map((n) => [n.name, n.running])).toEqual([["my-project", true]])
    expect(await manager.stop("my-project")).toBe(true)
    expect(started.closed).toBe(true)
    const again = await manager.connect("my-project")
    try {
      expect(again.id).toBe(started.id)
      expect((await again.run("cat note.txt")).stdout).toBe("remembered\n")
    } finally {
      await manager.stop("my-project")
    }
    await expect(manager.start("my-project", { source })).rejects.toMatchObject({ _tag: "NameTaken" })
  })

  it("SessionManager: a turn that fails (the VM died) still ends its busy spell: the idle timeout closes the session", async () => {
    const manager = new sdk.SessionManager()
    const session = await manager.start("dies", { source, timeout: 0.5 })
    const events = session.turn("echo started; sleep 60")[Symbol.asyncIterator]()
    await events.next()
    for (const pid of processesMentioning(session.dir)) process.kill(pid, "SIGKILL")
    await expect(
      (async () => {
        for (;;) if ((await events.next()).done === true) return
      })()
    ).rejects.toBeDefined()
    const deadline = Date.now() + 15_000
    while (!session.closed && Date.now() < deadline) await new Promise((r) => setTimeout(r, 100))
    expect(session.closed).toBe(true)
  })

  it("SessionManager: an idle timeout closes the session", async () => {
    const manager = new sdk.SessionManager()
    const session = await manager.start("idle", { source, timeout: 0.5 })
    await session.run("true")
    const deadline = Date.now() + 15_000
    while (!session.closed && Date.now() < deadline) await new Promise((r) => setTimeout(r, 100))
    expect(session.closed).toBe(true)
    expect((await manager.list()).find((n) => n.name === "idle")?.running).toBe(false)
  })
})
