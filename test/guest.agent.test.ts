/**
 * The real guest agent process against a minimal protocol v4 host (real unix socket, real Mux):
 * hello/ready, transfer, streaming turns, failing and cancelled turns, busy turns, bad messages,
 * shutdown, resume with context, privilege separation (as root), a corrupt config disk.
 */
import * as crypto from "node:crypto"
import * as fs from "node:fs"
import * as path from "node:path"
import { afterEach, describe, expect, it } from "@effect/vitest"
import { create as createTar } from "tar"
import { encodeFrame, FrameKind } from "../src/protocol/Frame.js"
import { acceptHost, isRoot, listenHost, makeGuestDirs, spawnGuest, writeConfig } from "./support/fakeHost.js"
import type { GuestDirs, GuestProcess, HostConnection } from "./support/fakeHost.js"
import type * as net from "node:net"

/** the only variables a turn gets: fixed ones, then the egress proxy's */
const allowedEnv = [
  "PATH",
  "HOME",
  "USER",
  "LANG",
  "ABOX_MODEL",
  ...["HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "NO_PROXY"].flatMap((name) => [name, name.toLowerCase()]),
  "NODE_USE_ENV_PROXY",
  // the same proxy in npm's, pip's and git's own spelling
  "npm_config_https_proxy",
  "npm_config_proxy",
  "PIP_PROXY",
  "GIT_CONFIG_COUNT",
  "GIT_CONFIG_KEY_0",
  "GIT_CONFIG_VALUE_0"
]

const cleanups: Array<() => void> = []
afterEach(() => {
  for (const cleanup of cleanups.splice(0).reverse()) cleanup()
})

const boot = async (dirs: GuestDirs, extra: ReadonlyArray<string> = []) => {
  const server: net.Server = await listenHost(dirs.socket)
  const accepted = acceptHost(server)
  const guest: GuestProcess = spawnGuest(dirs, extra)
  cleanups.push(() => {
    guest.child.kill("SIGKILL")
    server.close()
  })
  const host: HostConnection = await Promise.race([
    accepted,
    guest.exited.then((exit) => {
      throw new Error(`guest exited (${JSON.stringify(exit)}) before connecting:\n${guest.output()}`)
    })
  ])
  return { server, guest, host }
}

const turnEvents = (host: HostConnection, turn: number) =>
  host.received.filter((entry) => entry.message.type === "agent_event" && entry.message.turn === turn)

const stdoutOf = (host: HostConnection, turn: number) =>
  turnEvents(host, turn)
    .map((entry) =>
      entry.message.type === "agent_event" && entry.message.event.kind === "stdout"
        ? entry.message.event.data
        : ""
    )
    .join("")

const sendTar = async (
  host: HostConnection,
  channel: number,
  cwd: string,
  entries: ReadonlyArray<string>
) => {
  await host.mux.sendControl({ type: "transfer_begin", channel, format: "tar", target: "/work/repo" })
  const ch = host.mux.channel(channel)
  for await (const chunk of createTar({ cwd, portable: true }, [...entries]) as AsyncIterable<Buffer>) {
    await ch.write(chunk)
  }
  await ch.end()
}

describe("guest agent (real process, fake host)", () => {
  it("says hello, transfers, runs streaming / failing / cancelled turns, shuts down, resumes", async () => {
    const dirs = makeGuestDirs()
    writeConfig(dirs)
    // a small source tree with a symlink and an executable
    const src = path.join(dirs.root, "src")
    fs.mkdirSync(path.join(src, "sub"), { recursive: true })
    fs.writeFileSync(path.join(src, "README.md"), "hello\n")
    fs.writeFileSync(path.join(src, "sub", "run.sh"), "#!/bin/sh\necho ran\n", { mode: 0o755 })
    fs.symlinkSync("sub/run.sh", path.join(src, "link"))

    const { guest, host } = await boot(dirs)
    const hello = await host.next("hello")
    expect(hello.protocol).toBe(4)
    expect(hello.arch).toBe(process.arch === "arm64" ? "aarch64" : "x86_64")
    expect(hello.contextTurns).toBe(0)
    await host.next("ready")

    await sendTar(host, 2, src, ["README.md", "sub", "link"])
    const end = await host.next("transfer_end")
    expect(end).toMatchObject({ channel: 2, files: 3 })
    expect(fs.readFileSync(path.join(dirs.repo, "README.md"), "utf8")).toBe("hello\n")
    expect(fs.readlinkSync(path.join(dirs.repo, "link"))).toBe("sub/run.sh")
    expect(fs.statSync(path.join(dirs.repo, "sub", "run.sh")).mode & 0o777).toBe(0o755)
    if (isRoot) expect(fs.statSync(path.join(dirs.repo, "README.md")).uid).toBe(65534)

    // 1: streams output as it comes
    await host.mux.sendControl({
      type: "user_turn",
      turn: 1,
      text: "for i in 1 2 3; do echo tick $i; sleep 0.7; done"
    })
    const end1 = await host.next("turn_end")
    const endAt = host.received.find((entry) => entry.message.type === "turn_end")!.at
    const events1 = turnEvents(host, 1)
    expect(end1).toEqual({ type: "turn_end", turn: 1, exitCode: 0, signal: null, cancelled: false })
    expect(stdoutOf(host, 1)).toBe("tick 1\ntick 2\ntick 3\n")
    expect(events1.length).toBeGreaterThanOrEqual(2)
    expect(endAt - events1[0]!.at).toBeGreaterThan(1000)

    // 2: fails with exit 3, stderr streamed; a second turn while it runs is refused
    await host.mux.sendControl({
      type: "user_turn",
      turn: 2,
      text: "./sub/run.sh; echo oops >&2; sleep 0.5; exit 3"
    })
    await host.mux.sendControl({ type: "user_turn", turn: 99, text: "echo no" })
    const busy = await host.next("error")
    expect(busy).toMatchObject({ code: "turn_busy", turn: 99 })
    const end2 = await host.next("turn_end")
    expect(end2).toMatchObject({ turn: 2, exitCode: 3, signal: null, cancelled: false })
    expect(stdoutOf(host, 2)).toBe("ran\n")
    expect(
      turnEvents(host, 2).some((e) => e.message.type === "agent_event" && e.message.event.kind === "stderr")
    ).toBe(true)

    // 3: cancelled (the whole group, including a background child)
    await host.mux.sendControl({ type: "user_turn", turn: 3, text: "sleep 60 & echo started; wait" })
    await new Promise<void>((resolve) => {
      const check = () => (stdoutOf(host, 3).includes("started") ? resolve() : setTimeout(check, 20))
      check()
    })
    const cancelAt = Date.now()
    await host.mux.sendControl({ type: "cancel", turn: 3 })
    const end3 = await host.next("turn_end")
    expect(end3).toMatchObject({ turn: 3, cancelled: true, signal: "SIGTERM" })
    expect(Date.now() - cancelAt).toBeLessThan(3000)

    // a guest→host message type from the host: an error back, no crash
    await host.mux.sendControl({ type: "ready" })
    expect(await host.next("error")).toMatchObject({ code: "unexpected_message" })

    await host.mux.sendControl({ type: "shutdown" })
    const exit = await guest.exited
    expect(exit).toEqual({ code: 0, signal: null })
    await host.closed

    const context = JSON.parse(fs.readFileSync(path.join(dirs.state, "context.json"), "utf8")) as {
      format: number
      turns: Array<{ turn: number; exitCode: number | null; cancelled: boolean }>
      messages: Array<unknown>
    }
    // format 2: shell turns only, so no model conversation yet
    expect(context.format).toBe(2)
    expect(context.messages).toEqual([])
    expect(context.turns.map((t) => [t.turn, t.exitCode, t.cancelled])).toEqual([
      [1, 0, false],
      [2, 3, false],
      [3, null, true]
    ])

    // resume: same state and repo
    fs.rmSync(dirs.socket)
    const second = await boot(dirs)
    expect((await second.host.next("hello")).contextTurns).toBe(3)
    await second.host.mux.sendControl({ type: "user_turn", turn: 4, text: "cat README.md" })
    await second.host.next("turn_end")
    expect(stdoutOf(second.host, 4)).toBe("hello\n")
    await second.host.mux.sendControl({ type: "shutdown" })
    expect((await second.guest.exited).code).toBe(0)
  })

  it("keeps a corrupt context.json aside and starts with an empty history", async () => {
    const dirs = makeGuestDirs()
    writeConfig(dirs)
    fs.mkdirSync(dirs.state, { recursive: true })
    fs.writeFileSync(path.join(dirs.state, "context.json"), '{"format":1,"turns":[{"turn":"x"}]}')
    const { guest, host } = await boot(dirs)
    expect((await host.next("hello")).contextTurns).toBe(0)
    const aside = fs.readdirSync(dirs.state).filter((name) => name.startsWith("context.json.corrupt-"))
    expect(aside).toHaveLength(1)
    expect(fs.readFileSync(path.join(dirs.state, aside[0]!), "utf8")).toContain('"turn":"x"')
    await host.mux.sendControl({ type: "shutdown" })
    expect((await guest.exited).code).toBe(0)
  })

  it("reports a corrupt config disk to the host, then exits non-zero", async () => {
    const dirs = makeGuestDirs()
    writeConfig(dirs)
    const disk = fs.readFileSync(dirs.config)
    disk[60] = disk[60]! ^ 0xff // inside the JSON: the checksum no longer matches
    fs.writeFileSync(dirs.config, disk)
    const { guest, host } = await boot(dirs)
    const error = await host.next("error")
    expect(error.code).toBe("bad_config")
    expect(error.message).toContain("checksum")
    expect((await guest.exited).code).toBe(2)
    expect(host.received.some((entry) => entry.message.type === "hello")).toBe(false)
  })

  it("runs a configured agent command: stdin text, {model}, JSON lines", async () => {
    const dirs = makeGuestDirs()
    const script = path.join(dirs.root, "agent.sh")
    fs.writeFileSync(
      script,
      '#!/bin/sh\nread line\necho "{\\"model\\":\\"$1\\",\\"env\\":\\"$ABOX_MODEL\\",\\"got\\":\\"$line\\"}"\necho plain text\n',
      { mode: 0o755 }
    )
    fs.chmodSync(dirs.root, 0o755)
    writeConfig(dirs, { agent: { argv: [script, "{model}"] }, model: "m-1" })
    const { guest, host } = await boot(dirs)
    await host.next("ready")
    await host.mux.sendControl({ type: "user_turn", turn: 1, text: "fix it\n" })
    expect(await host.next("turn_end")).toMatchObject({ exitCode: 0 })
    const events = turnEvents(host, 1).map((entry) =>
      entry.message.type === "agent_event" ? entry.message.event : undefined
    )
    expect(events).toContainEqual({ kind: "json", value: { model: "m-1", env: "m-1", got: "fix it" } })
    expect(events).toContainEqual({ kind: "stdout", data: "plain text\n" })
    await host.mux.sendControl({ type: "shutdown" })
    expect((await guest.exited).code).toBe(0)
  })

  it("streams a large output completely (back pressure, events split to bounded sizes)", async () => {
    const dirs = makeGuestDirs()
    writeConfig(dirs)
    const { guest, host } = await boot(dirs)
    await host.next("ready")
    await host.mux.sendControl({ type: "user_turn", turn: 1, text: "head -c 3000000 /dev/zero | tr '\\0' x" })
    expect(await host.next("turn_end", 60_000)).toMatchObject({ exitCode: 0 })
    const events = turnEvents(host, 1)
    expect(stdoutOf(host, 1)).toBe("x".repeat(3_000_000))
    for (const entry of events) {
      if (entry.message.type === "agent_event" && entry.message.event.kind === "stdout") {
        expect(entry.message.event.data.length).toBeLessThanOrEqual(16 * 1024)
      }
    }
    await host.mux.sendControl({ type: "shutdown" })
    expect((await guest.exited).code).toBe(0)
  })

  it("binary output arrives byte for byte (base64 events), text output stays text", async () => {
    const dirs = makeGuestDirs()
    writeConfig(dirs)
    const { guest, host } = await boot(dirs)
    await host.next("ready")
    await host.mux.sendControl({
      type: "user_turn",
      turn: 1,
      text: 'f=$(mktemp); head -c 100000 /dev/urandom > "$f"; cat "$f"; sha256sum < "$f" >&2; rm -f "$f"'
    })
    expect(await host.next("turn_end", 60_000)).toMatchObject({ exitCode: 0 })
    const out: Array<Buffer> = []
    let err = ""
    for (const entry of turnEvents(host, 1)) {
      if (entry.message.type !== "agent_event") continue
      const event = entry.message.event
      if (event.kind === "stdout") {
        out.push(event.base64 !== undefined ? Buffer.from(event.base64, "base64") : Buffer.from(event.data))
        expect(Buffer.byteLength(event.data) + (event.base64?.length ?? 0)).toBeLessThan(1024 * 1024)
      }
      if (event.kind === "stderr") err += event.data
    }
    const bytes = Buffer.concat(out)
    expect(bytes.length).toBe(100_000)
    expect(crypto.createHash("sha256").update(bytes).digest("hex")).toBe(err.split(" ")[0])
    // UTF-8 text, a multi-byte character cut by no matter which read, is text without base64
    await host.mux.sendControl({ type: "user_turn", turn: 2, text: "for i in 1 2 3; do printf 'h\\303'; sleep 0.1; printf '\\251llo\\n'; done" })
    expect(await host.next("turn_end", 60_000)).toMatchObject({ turn: 2, exitCode: 0 })
    const events = turnEvents(host, 2).flatMap((e) => (e.message.type === "agent_event" ? [e.message.event] : []))
    expect(events.every((e) => !("base64" in e) || e.base64 === undefined)).toBe(true)
    expect(stdoutOf(host, 2)).toBe("héllo\n".repeat(3))
    await host.mux.sendControl({ type: "shutdown" })
    expect((await guest.exited).code).toBe(0)
  })

  it("cancel escalates to SIGKILL when the turn ignores SIGTERM", async () => {
    const dirs = makeGuestDirs()
    writeConfig(dirs)
    const { guest, host } = await boot(dirs)
    await host.next("ready")
    await host.mux.sendControl({
      type: "user_turn",
      turn: 1,
      text: "trap '' TERM; echo armed; while :; do sleep 0.1; done"
    })
    await new Promise<void>((resolve) => {
      const check = () => (stdoutOf(host, 1).includes("armed") ? resolve() : setTimeout(check, 20))
      check()
    })
    const at = Date.now()
    await host.mux.sendControl({ type: "cancel", turn: 1 })
    expect(await host.next("turn_end")).toMatchObject({ turn: 1, cancelled: true, signal: "SIGKILL" })
    const took = Date.now() - at
    expect(took).toBeGreaterThanOrEqual(1500)
    expect(took).toBeLessThan(5000)
    await host.mux.sendControl({ type: "shutdown" })
    expect((await guest.exited).code).toBe(0)
  })

  it("a turn whose agent cannot start ends with 127 and says why", async () => {
    const dirs = makeGuestDirs()
    writeConfig(dirs, { agent: { argv: ["/nonexistent/agent"] } })
    const { guest, host } = await boot(dirs)
    await host.next("ready")
    await host.mux.sendControl({ type: "user_turn", turn: 1, text: "hi" })
    expect(await host.next("turn_end")).toMatchObject({ turn: 1, exitCode: 127 })
    const stderr = turnEvents(host, 1).map((e) =>
      e.message.type === "agent_event" && e.message.event.kind === "stderr" ? e.message.event.data : ""
    )
    expect(stderr.join("")).toContain("could not start")
    await host.mux.sendControl({ type: "shutdown" })
    expect((await guest.exited).code).toBe(0)
  })

  it("a transfer outside the repository is refused with an error, and the agent goes on", async () => {
    const dirs = makeGuestDirs()
    writeConfig(dirs)
    const { guest, host } = await boot(dirs)
    await host.next("ready")
    await host.mux.sendControl({ type: "transfer_begin", channel: 2, format: "tar", target: "/etc" })
    const ch = host.mux.channel(2)
    await ch.write(new Uint8Array(1024))
    await ch.end()
    expect(await host.next("error")).toMatchObject({ code: "transfer_failed", channel: 2 })
    await host.mux.sendControl({ type: "user_turn", turn: 1, text: "echo still here" })
    await host.next("turn_end")
    expect(stdoutOf(host, 1)).toBe("still here\n")
    await host.mux.sendControl({ type: "shutdown" })
    expect((await guest.exited).code).toBe(0)
  })

  it("malformed control JSON: the guest answers with an error and ends the conversation cleanly", async () => {
    const dirs = makeGuestDirs()
    writeConfig(dirs)
    const { guest, host } = await boot(dirs)
    await host.next("ready")
    host.socket.write(
      encodeFrame({ channel: 0, kind: FrameKind.Control, payload: new TextEncoder().encode("{nope") })
    )
    expect(await host.next("error")).toMatchObject({ code: "protocol_error" })
    expect((await guest.exited).code).toBe(5)
    expect(guest.output()).toContain("protocol error from the host")
  })

  it("HTTPS egress: a turn's CONNECT becomes a tunnel the host accepts or denies; CA files are set", async () => {
    const dirs = makeGuestDirs()
    fs.chmodSync(dirs.root, 0o755)
    const pem = "-----BEGIN CERTIFICATE-----\nTESTCA\n-----END CERTIFICATE-----\n"
    writeConfig(dirs, { brokerCaCert: pem })
    const { guest, host } = await boot(dirs)
    await host.next("ready")
    const opened: Array<string> = []
    host.listeners.push((message) => {
      if (message.type !== "tunnel_open") return
      opened.push(`${message.host}:${message.port}`)
      if (message.host !== "allowed.test") {
        void host.mux.sendControl({
          type: "tunnel_deny",
          channel: message.channel,
          reason: "not on the allowlist"
        })
        return
      }
      void (async () => {
        const channel = host.mux.channel(message.channel)
        await host.mux.sendControl({ type: "tunnel_accept", channel: message.channel })
        let request = ""
        for await (const chunk of channel.readable) {
          request += Buffer.from(chunk).toString("latin1")
          if (request.includes("\r\n\r\n")) break
        }
        const body = `via tunnel ${message.channel}: ${request.split("\r\n")[0]}\n`
        await channel.write(
          Buffer.from(`HTTP/1.1 200 OK\r\nContent-Length: ${body.length}\r\nConnection: close\r\n\r\n${body}`)
        )
        await channel.end()
      })()
    })
    await host.mux.sendControl({
      type: "user_turn",
      turn: 1,
      text: [
        'echo "proxy=$HTTPS_PROXY"',
        'tail -n 2 "$SSL_CERT_FILE"',
        'cat "$NODE_EXTRA_CA_CERTS" | head -n 1',
        'curl -sS -p -x "$HTTPS_PROXY" http://allowed.test:8443/hello',
        'curl -sS -p -x "$HTTPS_PROXY" http://denied.test:443/ 2>/dev/null; echo "denied rc=$?"'
      ].join("; ")
    })
    await host.next("turn_end")
    const out = stdoutOf(host, 1)
    expect(out).toMatch(/^proxy=http:\/\/127\.0\.0\.1:\d+\n/)
    expect(out).toContain("TESTCA\n-----END CERTIFICATE-----\n-----BEGIN CERTIFICATE-----\n")
    expect(out).toMatch(/via tunnel 1: GET \/hello HTTP\/1\.1\n/)
    expect(out).toContain("denied rc=56")
    expect(opened).toEqual(["allowed.test:8443", "denied.test:443"])
    expect(host.received.some((entry) => entry.message.type === "tunnel_close")).toBe(true)
    await host.mux.sendControl({ type: "shutdown" })
    expect((await guest.exited).code).toBe(0)
  })

  it.skipIf(!isRoot)(
    "turn processes run unprivileged: cannot kill the agent or write its state",
    async () => {
      const dirs = makeGuestDirs()
      writeConfig(dirs)
      const { guest, host } = await boot(dirs)
      await host.next("ready")
      const pid = guest.child.pid!
      await host.mux.sendControl({
        type: "user_turn",
        turn: 1,
        text: `id -u; id -g; kill -9 ${pid} 2>/dev/null && echo KILLED; echo x > ${dirs.state}/pwned 2>/dev/null && echo WROTE; ls ${dirs.state} 2>/dev/null && echo LISTED; env | sort`
      })
      await host.next("turn_end")
      const out = stdoutOf(host, 1)
      const lines = out.split("\n")
      expect(lines[0]).toBe("65534")
      expect(lines[1]).toBe("65534")
      expect(out).not.toContain("KILLED")
      expect(out).not.toContain("WROTE")
      expect(out).not.toContain("LISTED")
      expect(fs.existsSync(path.join(dirs.state, "pwned"))).toBe(false)
      expect(fs.statSync(dirs.state).mode & 0o777).toBe(0o700)
      // a clean environment: only the fixed variables (+ what sh itself sets)
      const names = lines.filter((line) => line.includes("=")).map((line) => line.slice(0, line.indexOf("=")))
      expect(names).toEqual(expect.arrayContaining(["PATH", "HOME", "USER", "LANG", "ABOX_MODEL"]))
      for (const name of names) expect([...allowedEnv, "PWD", "SHLVL", "_", "OLDPWD"]).toContain(name)
      // the agent survived and still answers
      await host.mux.sendControl({ type: "shutdown" })
      expect((await guest.exited).code).toBe(0)
    }
  )
})
