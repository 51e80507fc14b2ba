/**
 * Guest agent pieces without a process: flags, context.json, users, transfer targets.
 */
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { describe, expect, it } from "@effect/vitest"
import * as Either from "effect/Either"
import * as fc from "fast-check"
import { archName, resolveTarget } from "../src/guest/agent.js"
import { ensureStateDir, loadContext, saveContext, type ContextTurn } from "../src/guest/context.js"
import { DEFAULT_FLAGS, parseArgs, rpcTarget } from "../src/guest/flags.js"
import { incompleteUtf8Tail, MAX_EVENT_BYTES, OutputChunker } from "../src/guest/turns.js"
import { MAX_TUNNELS, TunnelClient } from "../src/guest/tunnels.js"
import { resolveUser } from "../src/guest/user.js"
import type { AgentLink } from "../src/guest/agent.js"
import type { AgentEvent } from "../src/protocol/Messages.js"

const tmp = () => fs.mkdtempSync(path.join(os.tmpdir(), "abox-guest-unit-"))

const turn = (n: number): ContextTurn => ({
  turn: n,
  text: `echo ${n}`,
  exitCode: n === 2 ? null : 0,
  signal: n === 2 ? "SIGTERM" : null,
  cancelled: n === 2,
  startedAt: "2026-01-01T00:00:00.000Z",
  endedAt: "2026-01-01T00:00:01.000Z"
})

describe("guest flags", () => {
  it("defaults are the in-VM layout", () => {
    expect(parseArgs([])).toEqual(Either.right({ _tag: "Run", flags: DEFAULT_FLAGS }))
    expect(DEFAULT_FLAGS).toMatchObject({
      config: "/dev/vdb",
      rpc: "auto",
      state: "/var/lib/abox",
      repo: "/work/repo"
    })
  })

  it("takes --flag value and --flag=value; rejects unknown flags, missing values and bad values", () => {
    const parsed = parseArgs(["--rpc", "unix:/tmp/x.sock", "--user=65534:65534", "--on-shutdown", "exit"])
    expect(Either.getOrThrow(parsed)).toMatchObject({
      _tag: "Run",
      flags: { rpc: "unix:/tmp/x.sock", user: "65534:65534", onShutdown: "exit" }
    })
    expect(Either.isLeft(parseArgs(["--nope"]))).toBe(true)
    expect(Either.isLeft(parseArgs(["--state"]))).toBe(true)
    expect(Either.isLeft(parseArgs(["--on-shutdown", "reboot"]))).toBe(true)
    expect(Either.isLeft(parseArgs(["--rpc", "tcp:1.2.3.4:5"]))).toBe(true)
    expect(Either.isLeft(parseArgs(["--rpc", "vsock:abc"]))).toBe(true)
    expect(parseArgs(["--help"])).toEqual(Either.right({ _tag: "Help" }))
  })

  it("rpc targets", () => {
    expect(rpcTarget("auto")).toEqual({ _tag: "Auto" })
    expect(rpcTarget("unix:/a b/rpc.sock")).toEqual({ _tag: "Unix", path: "/a b/rpc.sock" })
    expect(rpcTarget("vsock:1024")).toEqual({ _tag: "Vsock", port: 1024 })
    expect(rpcTarget("/dev/vport0p1")).toEqual({ _tag: "Device", path: "/dev/vport0p1" })
  })
})

describe("guest context.json", () => {
  it("round-trips, atomically (no temp file left), in a 0700 state dir", async () => {
    const state = path.join(tmp(), "state")
    await ensureStateDir(state)
    expect(fs.statSync(state).mode & 0o777).toBe(0o700)
    expect(await loadContext(state)).toEqual({ turns: [] })
    await saveContext(state, [turn(1), turn(2)])
    await saveContext(state, [turn(1), turn(2), turn(3)])
    expect((await loadContext(state)).turns).toEqual([turn(1), turn(2), turn(3)])
    expect(fs.readdirSync(state)).toEqual(["context.json"])
    expect(fs.statSync(path.join(state, "context.json")).mode & 0o777).toBe(0o600)
  })

  it("keeps a corrupt or too-new file aside and starts empty", async () => {
    for (const content of ["{not json", '{"format":2,"turns":[]}', '{"format":1,"turns":[{"turn":1}]}']) {
      const state = tmp()
      fs.writeFileSync(path.join(state, "context.json"), content)
      const loaded = await loadContext(state, () => new Date("2026-02-03T04:05:06.789Z"))
      expect(loaded.turns).toEqual([])
      expect(loaded.keptAside?.path).toBe(path.join(state, "context.json.corrupt-2026-02-03T04-05-06-789Z"))
      expect(fs.readFileSync(loaded.keptAside!.path, "utf8")).toBe(content)
      expect(fs.existsSync(path.join(state, "context.json"))).toBe(false)
    }
  })

  it("property: any history survives save → load", async () => {
    const state = tmp()
    const arbTurn = fc.record({
      turn: fc.nat(),
      text: fc.string(),
      exitCode: fc.option(fc.integer({ min: 0, max: 255 }), { nil: null }),
      signal: fc.option(fc.constantFrom("SIGTERM", "SIGKILL"), { nil: null }),
      cancelled: fc.boolean(),
      startedAt: fc.constant("2026-01-01T00:00:00.000Z"),
      endedAt: fc.constant("2026-01-01T00:00:02.000Z")
    })
    await fc.assert(
      fc.asyncProperty(fc.array(arbTurn, { maxLength: 5 }), async (turns) => {
        await saveContext(state, turns)
        expect((await loadContext(state)).turns).toEqual(turns)
      }),
      { numRuns: 40 }
    )
  })
})

describe("guest users and targets", () => {
  it("resolves names through passwd and uid:gid without it", async () => {
    const passwd = path.join(tmp(), "passwd")
    fs.writeFileSync(passwd, "root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000::/home/agent:/bin/sh\n")
    expect(await resolveUser("agent", passwd)).toEqual({
      name: "agent",
      uid: 1000,
      gid: 1000,
      home: "/home/agent"
    })
    expect(await resolveUser("1000:1000", passwd)).toMatchObject({
      name: "agent",
      uid: 1000,
      home: "/home/agent"
    })
    expect(await resolveUser("4242:4343", passwd)).toEqual({
      name: "uid4242",
      uid: 4242,
      gid: 4343,
      home: "/"
    })
    await expect(resolveUser("nobody-here", passwd)).rejects.toThrow(/not in/)
  })

  it("maps /work/repo targets onto --repo and refuses anything outside it", () => {
    expect(resolveTarget("/work/repo", "/tmp/r")).toBe("/tmp/r")
    expect(resolveTarget("/work/repo/sub", "/tmp/r")).toBe("/tmp/r/sub")
    expect(resolveTarget("/tmp/r/x", "/tmp/r")).toBe("/tmp/r/x")
    expect(resolveTarget("/work/repo/../etc", "/tmp/r")).toBeUndefined()
    expect(resolveTarget("/etc", "/tmp/r")).toBeUndefined()
    expect(resolveTarget("/tmp/rx", "/tmp/r")).toBeUndefined()
  })

  it("arch names", () => {
    expect(archName("x64")).toBe("x86_64")
    expect(archName("arm64")).toBe("aarch64")
  })
})

describe("guest output chunking (byte-exact)", () => {
  const bytesOf = (events: ReadonlyArray<AgentEvent>): Buffer =>
    Buffer.concat(
      events.map((e) =>
        e.kind === "stdout" ? (e.base64 !== undefined ? Buffer.from(e.base64, "base64") : Buffer.from(e.data)) : Buffer.alloc(0)
      )
    )
  const run = (chunks: ReadonlyArray<Uint8Array>) => {
    const chunker = new OutputChunker("stdout")
    return [...chunks.flatMap((c) => chunker.push(c)), ...chunker.end()]
  }
  const cut = (bytes: Uint8Array, at: ReadonlyArray<number>) => {
    const points = [...new Set(at.map((n) => n % (bytes.length + 1)))].sort((a, b) => a - b)
    const chunks: Array<Uint8Array> = []
    let start = 0
    for (const p of [...points, bytes.length]) {
      chunks.push(bytes.subarray(start, p))
      start = p
    }
    return chunks
  }

  it("any bytes, cut anywhere: the events' bytes are the stream, each event ≤ MAX_EVENT_BYTES", () => {
    fc.assert(
      fc.property(fc.uint8Array({ maxLength: 40_000 }), fc.array(fc.nat(), { maxLength: 8 }), (bytes, at) => {
        const events = run(cut(bytes, at))
        expect(bytesOf(events).equals(Buffer.from(bytes))).toBe(true)
        for (const e of events) if (e.kind === "stdout") expect(e.base64 === undefined ? Buffer.byteLength(e.data) : Buffer.from(e.base64, "base64").length).toBeLessThanOrEqual(MAX_EVENT_BYTES)
      }),
      { numRuns: 200 }
    )
  })

  it("UTF-8 text, cut anywhere (inside characters too), is all text: no base64", () => {
    fc.assert(
      fc.property(fc.string({ unit: "grapheme", maxLength: 20_000 }), fc.array(fc.nat(), { maxLength: 8 }), (text, at) => {
        const events = run(cut(Buffer.from(text), at))
        expect(events.every((e) => e.kind === "stdout" && e.base64 === undefined)).toBe(true)
        expect(events.map((e) => (e.kind === "stdout" ? e.data : "")).join("")).toBe(text)
      }),
      { numRuns: 200 }
    )
  })

  it("a cut multi-byte character waits for its rest; an unfinished one at the end is sent as bytes", () => {
    expect(incompleteUtf8Tail(Buffer.from([0x68, 0xc3]))).toBe(1)
    expect(incompleteUtf8Tail(Buffer.from([0xe2, 0x9c]))).toBe(2)
    expect(incompleteUtf8Tail(Buffer.from("h\u00e9"))).toBe(0)
    expect(run([Buffer.from([0x68, 0xc3]), Buffer.from([0xa9])])).toEqual([
      { kind: "stdout", data: "h" },
      { kind: "stdout", data: "\u00e9" }
    ])
    expect(run([Buffer.from([0x68, 0xc3])])).toEqual([
      { kind: "stdout", data: "h" },
      { kind: "stdout", data: "\ufffd", base64: "ww==" }
    ])
  })
})

describe("guest tunnels", () => {
  it("holds at most MAX_TUNNELS at once: the next CONNECT is refused in the guest, never sent", async () => {
    let sent = 0
    const channels: Array<number> = []
    const link = {
      sendControl: () => {
        sent++
        return new Promise<void>(() => undefined) // the host never answers
      },
      channel: (id: number) => {
        channels.push(id)
        return { destroy: () => undefined }
      }
    } as unknown as AgentLink
    const client = new TunnelClient(link, () => undefined)
    for (let i = 0; i < MAX_TUNNELS; i++) void client.request("h.test", 443)
    expect(await client.request("h.test", 443)).toEqual({ ok: false, reason: `too many tunnels (${MAX_TUNNELS}) open at once` })
    expect(sent).toBe(MAX_TUNNELS)
    // ids count up by two from 1: what the host requires
    expect(channels.slice(0, 3)).toEqual([1, 3, 5])
  })
})
