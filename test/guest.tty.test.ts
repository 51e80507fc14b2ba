/**
 * TTY turns against the real BusyBox telnetd (the image's /bin/busybox is the same applet): the
 * telnet codec's units, then real turns on a real pty: the tty and its size, a resize while the
 * command runs, typed input, ^C as a real SIGINT (status 130), a forwarded signal, cancel, and the
 * exit status through the wrapper (telnetd itself always exits 0).
 */
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { describe, expect, it } from "@effect/vitest"
import type * as net from "node:net"
import { connect as netConnect } from "node:net"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Queue from "effect/Queue"
import * as Stream from "effect/Stream"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { Mux } from "../src/protocol/Mux.js"
import { GuestRpc, type TtyControl } from "../src/services/GuestRpc.js"
import { afterEach } from "@effect/vitest"
import type { AgentEvent, ControlMessage } from "../src/protocol/Messages.js"
import { acceptHost, listenHost, makeGuestDirs, spawnGuest, writeConfig } from "./support/fakeHost.js"
import { BUSYBOX, encodeInput, encodeResize, TelnetDecoder, TtyTurnRunner } from "../src/guest/ttyTurns.js"

const hasBusybox = fs.existsSync(BUSYBOX)
const isRoot = process.getuid?.() === 0

describe("telnet codec", () => {
  it("drops negotiation and SB blocks, undoubles IAC IAC, drops the leading CR CR LF", () => {
    const decoder = new TelnetDecoder()
    const wire = Buffer.from([
      0xff,
      0xfd,
      0x01,
      0xff,
      0xfd,
      0x1f,
      0xff,
      0xfb,
      0x01,
      0xff,
      0xfb,
      0x03, // negotiation
      0x0d,
      0x0d,
      0x0a, // telnetd's leading line
      0x61,
      0xff,
      0xff,
      0x62, // a, 0xFF, b
      0xff,
      0xfa,
      0x18,
      0x01,
      0xff,
      0xf0, // an SB block
      0x63
    ])
    // byte by byte: every sequence cut by a read
    const out = Buffer.concat([...wire].map((b) => decoder.push(Buffer.from([b]))).concat([decoder.end()]))
    expect([...out]).toEqual([0x61, 0xff, 0x62, 0x63])
  })

  it("keeps a command's own CR at the start when it is not telnetd's sequence", () => {
    const decoder = new TelnetDecoder()
    expect(Buffer.concat([decoder.push(Buffer.from("\r\rx")), decoder.end()]).toString()).toBe("\r\rx")
    const short = new TelnetDecoder()
    expect(Buffer.concat([short.push(Buffer.from("\r")), short.end()]).toString()).toBe("\r")
  })

  it("doubles 0xFF and sends CR as CR NUL; NAWS with 0xFF doubled", () => {
    expect([...encodeInput(Buffer.from([0x61, 0xff, 0x0d, 0x0a]))]).toEqual([
      0x61, 0xff, 0xff, 0x0d, 0x00, 0x0a
    ])
    expect([...encodeResize(40, 120)]).toEqual([0xff, 0xfa, 31, 0, 120, 0, 40, 0xff, 0xf0])
    expect([...encodeResize(255, 511)]).toEqual([0xff, 0xfa, 31, 1, 0xff, 0xff, 0, 0xff, 0xff, 0xff, 0xf0])
  })
})

const text = (events: ReadonlyArray<AgentEvent>): string =>
  Buffer.concat(
    events.map((event) =>
      event.kind === "stdout"
        ? event.base64 !== undefined
          ? Buffer.from(event.base64, "base64")
          : Buffer.from(event.data, "utf8")
        : Buffer.alloc(0)
    )
  ).toString("latin1")

const makeRunner = () => {
  const repoDir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-tty-repo-"))
  fs.chmodSync(repoDir, 0o755)
  return new TtyTurnRunner({
    repoDir,
    model: "test",
    user: isRoot ? { name: "nobody", uid: 65534, gid: 65534, home: "/" } : undefined,
    killAfterMs: 2000
  })
}

/** waits until the output so far contains `needle` */
const waitFor = async (events: ReadonlyArray<AgentEvent>, needle: string) => {
  for (let i = 0; i < 600; i++) {
    if (text(events).includes(needle)) return
    await new Promise((resolve) => setTimeout(resolve, 50))
  }
  throw new Error(`no ${JSON.stringify(needle)} in ${JSON.stringify(text(events))}`)
}

describe.skipIf(!hasBusybox)("tty turns on busybox telnetd", () => {
  it("a pty of the asked size, resize, input, TERM, the exit status", { timeout: 60_000 }, async () => {
    const runner = makeRunner()
    const events: Array<AgentEvent> = []
    const outcome = runner.run(
      1,
      `tty; stty size; echo "term=$TERM"; echo ready; read line; stty size; printf 'got=%s\\377\\n' "$line"; [ "$(id -u)" = "${isRoot ? 65534 : process.getuid?.()}" ] && exit 7`,
      { rows: 33, cols: 101, term: "xterm-256color" },
      (event) => {
        events.push(event)
      }
    )
    await waitFor(events, "ready")
    expect(runner.resize(1, 50, 200)).toBe(true)
    await new Promise((resolve) => setTimeout(resolve, 300))
    expect(runner.input(1, Buffer.from("hello \xff\r", "latin1"))).toBe(true)
    const result = await outcome
    const out = text(events)
    expect(out).toMatch(/^\/dev\/pts\/\d+\r\n33 101\r\nterm=xterm-256color\r\nready\r\n/)
    expect(out).toContain("50 200\r\n")
    // the line discipline echoes the typed line; the command read it whole (0xFF intact)
    expect(out).toContain("got=hello \xff\xff\r\n")
    expect(result).toEqual({ exitCode: 7, signal: null, cancelled: false })
    expect(runner.current).toBeUndefined()
  })

  it(
    "^C on input is a SIGINT in the command (130); a forwarded signal and cancel end it too",
    { timeout: 60_000 },
    async () => {
      const runner = makeRunner()
      const events: Array<AgentEvent> = []
      const sink = (event: AgentEvent) => {
        events.push(event)
      }
      const first = runner.run(2, "echo ready; sleep 30; echo not-reached", { rows: 24, cols: 80 }, sink)
      await waitFor(events, "ready")
      runner.input(2, Buffer.from([0x03]))
      expect(await first).toEqual({ exitCode: 130, signal: null, cancelled: false })
      expect(text(events)).not.toContain("not-reached")

      events.length = 0
      const second = runner.run(3, "echo ready; sleep 30", { rows: 24, cols: 80 }, sink)
      await waitFor(events, "ready")
      expect(await runner.signal(3, "SIGTERM")).toBe(true)
      expect(await second).toEqual({ exitCode: 143, signal: null, cancelled: false })

      events.length = 0
      const third = runner.run(4, "echo ready; sleep 30", { rows: 24, cols: 80 }, sink)
      await waitFor(events, "ready")
      expect(runner.cancel(4)).toBe(true)
      expect(await third).toMatchObject({ cancelled: true })
      expect(runner.input(4, Buffer.from("x"))).toBe(false)
    }
  )

  it(
    "no repository to run in: the turn cannot start (rejects, as other turns do) and leaves nothing",
    { timeout: 60_000 },
    async () => {
      const runner = new TtyTurnRunner({ repoDir: "/nonexistent-abox-repo", model: "test", user: undefined })
      const before = fs.readdirSync(os.tmpdir()).filter((name) => name.startsWith("abox-tty-")).length
      await expect(runner.run(5, "true", { rows: 24, cols: 80 }, () => undefined)).rejects.toThrow(/ENOENT/)
      expect(runner.current).toBeUndefined()
      expect(fs.readdirSync(os.tmpdir()).filter((name) => name.startsWith("abox-tty-")).length).toBe(before)
    }
  )
})

const cleanups: Array<() => void> = []
afterEach(() => {
  for (const cleanup of cleanups.splice(0).reverse()) cleanup()
})

const stdoutOf = (received: ReadonlyArray<{ readonly message: ControlMessage }>, turn: number): string =>
  text(
    received.flatMap(({ message }) =>
      message.type === "agent_event" && message.turn === turn ? [message.event] : []
    )
  )

describe.skipIf(!hasBusybox)("tty turns through the real guest agent (protocol v4, FEATURE_TTY)", () => {
  it(
    "offers tty in hello; tty_turn, turn_resize, turn_input, turn_signal; turn_end carries the status",
    { timeout: 60_000 },
    async () => {
      const dirs = makeGuestDirs()
      fs.chmodSync(dirs.root, 0o755) // the turn user (65534 as root) enters the repository
      writeConfig(dirs)
      const server: net.Server = await listenHost(dirs.socket)
      const accepted = acceptHost(server)
      const guest = spawnGuest(dirs)
      cleanups.push(() => {
        guest.child.kill("SIGKILL")
        server.close()
      })
      const host = await accepted
      const hello = await host.next("hello")
      expect(hello.features).toContain("tty")
      await host.next("ready")

      const waitOut = async (turn: number, needle: string) => {
        for (let i = 0; i < 600 && !stdoutOf(host.received, turn).includes(needle); i++) {
          await new Promise((resolve) => setTimeout(resolve, 50))
        }
        expect(stdoutOf(host.received, turn)).toContain(needle)
      }

      await host.mux.sendControl({
        type: "tty_turn",
        turn: 1,
        text: 'stty size; echo ready; read line; stty size; echo "got=$line"; exit 5',
        rows: 30,
        cols: 90,
        term: "xterm"
      })
      await waitOut(1, "ready")
      // a user_turn while the tty turn runs is refused: one turn at a time
      await host.mux.sendControl({ type: "user_turn", turn: 2, text: "true" })
      expect(await host.next("error")).toMatchObject({ code: "turn_busy", turn: 2 })
      await host.mux.sendControl({ type: "turn_resize", turn: 1, rows: 40, cols: 132 })
      await new Promise((resolve) => setTimeout(resolve, 300))
      await host.mux.sendControl({
        type: "turn_input",
        turn: 1,
        data: Buffer.from("typed\r").toString("base64")
      })
      expect(await host.next("turn_end")).toEqual({
        type: "turn_end",
        turn: 1,
        exitCode: 5,
        signal: null,
        cancelled: false
      })
      const out = stdoutOf(host.received, 1)
      expect(out).toMatch(/^30 90\r\nready\r\n/)
      expect(out).toContain("40 132\r\ngot=typed\r\n")

      await host.mux.sendControl({
        type: "tty_turn",
        turn: 3,
        text: "echo ready; sleep 30",
        rows: 24,
        cols: 80
      })
      await waitOut(3, "ready")
      await host.mux.sendControl({ type: "turn_signal", turn: 3, signal: "SIGINT" })
      expect(await host.next("turn_end")).toEqual({
        type: "turn_end",
        turn: 3,
        exitCode: 130,
        signal: null,
        cancelled: false
      })

      // input for a turn that has ended crossed its end on the wire: dropped, no error
      await host.mux.sendControl({ type: "turn_input", turn: 3, data: "eA==" })
      await host.mux.sendControl({ type: "shutdown" })
      expect((await guest.exited).code).toBe(0)
      expect(host.received.filter(({ message }) => message.type === "error")).toHaveLength(1)
    }
  )
})

describe.skipIf(!hasBusybox)("GuestConnection.ttyTurn (host GuestRpcLive ↔ the real guest agent)", () => {
  it.live(
    "controls go to the guest while the turn runs; End carries the status",
    () =>
      Effect.gen(function* () {
        const dirs = makeGuestDirs()
        fs.chmodSync(dirs.root, 0o755)
        writeConfig(dirs)
        const rpc = yield* GuestRpc
        const { accept } = yield* rpc.listen(dirs.socket, {
          helloTimeout: "30 seconds",
          shutdownTimeout: "10 seconds"
        })
        const guest = spawnGuest(dirs)
        yield* Effect.addFinalizer(() => Effect.sync(() => guest.child.kill("SIGKILL")))
        const connection = yield* accept
        expect(connection.hello.features).toContain("tty")
        const controls = yield* Queue.unbounded<TtyControl>()
        const events: Array<AgentEvent> = []
        let fed = false
        const end = yield* connection
          .ttyTurn('stty size; echo ready; read line; stty size; echo "got=$line"; exit 9', {
            rows: 20,
            cols: 70,
            term: "vt100",
            controls: Stream.fromQueue(controls)
          })
          .pipe(
            Stream.tap((event) =>
              Effect.gen(function* () {
                if (event._tag !== "Event") return
                events.push(event.event)
                if (!fed && text(events).includes("ready")) {
                  fed = true
                  yield* Queue.offer(controls, { _tag: "Resize", rows: 45, cols: 150 })
                  yield* Effect.sleep("300 millis")
                  yield* Queue.offer(controls, { _tag: "Input", bytes: Buffer.from("over rpc\r") })
                }
              })
            ),
            Stream.runLast
          )
        expect(Option.getOrThrow(end)).toEqual({ _tag: "End", exitCode: 9, signal: null, cancelled: false })
        const out = text(events)
        expect(out).toMatch(/^20 70\r\nready\r\n/)
        expect(out).toContain("45 150\r\ngot=over rpc\r\n")
      }).pipe(Effect.scoped, Effect.provide(GuestRpcLive)),
    60_000
  )

  it.live(
    "a guest that does not offer tty: TtyUnsupported, and nothing is sent to it",
    () =>
      Effect.gen(function* () {
        const dirs = makeGuestDirs()
        const rpc = yield* GuestRpc
        const { accept } = yield* rpc.listen(dirs.socket, {
          helloTimeout: "30 seconds",
          shutdownTimeout: "5 seconds"
        })
        const received: Array<ControlMessage> = []
        const socket = netConnect(dirs.socket)
        yield* Effect.addFinalizer(() => Effect.sync(() => socket.destroy()))
        const mux = new Mux(socket)
        mux.onControl((message) => {
          received.push(message)
          if (message.type === "shutdown") mux.close()
        })
        mux.onError(() => undefined)
        void mux.sendControl({
          type: "hello",
          protocol: 4,
          arch: "x86_64",
          build: "old",
          features: ["export"]
        })
        void mux.sendControl({ type: "ready" })
        const connection = yield* accept
        const error = yield* connection
          .ttyTurn("true", { rows: 24, cols: 80, controls: Stream.empty })
          .pipe(Stream.runDrain, Effect.flip)
        expect(error._tag).toBe("TtyUnsupported")
        expect(received).toEqual([])
      }).pipe(Effect.scoped, Effect.provide(GuestRpcLive)),
    30_000
  )
})
