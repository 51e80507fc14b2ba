/**
 * The detached supervisor's control protocol against FakeVmm (the real guest agent as a host
 * process, the real store, lock, protocol and control socket): status, concurrent turns, attach
 * (replay, one typist), a client that goes away mid-turn, cancel, timeout, stop, the idle
 * timeout (TestClock), a stale control socket.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import * as TestClock from "effect/TestClock"
import { type ChildProcess, spawn } from "node:child_process"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import {
  type ControlReply,
  type ControlRequest,
  REPO_CHUNK,
  type TurnRequest
} from "../src/protocol/Control.js"
import { connect, forward, remoteRepo, status, statusIfRunning, stop } from "../src/programs/detached.js"
import { open, resume } from "../src/programs/session.js"
import { supervise } from "../src/programs/supervisor.js"
import { controlSocketPath } from "../src/lib/socketPath.js"
import { processesMentioning } from "./support/processes.js"
import { fakeLifecycle } from "./support/fakeLifecycle.js"

const tempDir = (prefix: string) => fs.mkdtempSync(path.join(os.tmpdir(), prefix))

const layerFor = (home: string) => fakeLifecycle(home)

const source = () => {
  const dir = tempDir("abox-src-")
  fs.writeFileSync(path.join(dir, "README.md"), "detached\n")
  return dir
}

/** a real-time pause (the tests under TestClock use it to let other processes move) */
const realSleep = (ms: number) => Effect.promise(() => new Promise((resolve) => setTimeout(resolve, ms)))

/** one exec: every reply until the turn's end (or an error) */
const exec = (ref: string, request: Omit<TurnRequest, "type">) =>
  Effect.scoped(
    Effect.gen(function* () {
      const connection = yield* connect(ref)
      yield* connection.send({ type: "turn", ...request })
      return Chunk.toArray(
        yield* connection.replies.pipe(
          Stream.takeUntil((reply) => reply.type === "turn_end" || reply.type === "error"),
          Stream.runCollect
        )
      )
    })
  )

const stdoutOf = (replies: ReadonlyArray<ControlReply>) =>
  replies.map((r) => (r.type === "event" && r.event.kind === "stdout" ? r.event.data : "")).join("")
const endOf = (replies: ReadonlyArray<ControlReply>) => replies.find((r) => r.type === "turn_end")

describe("detached supervisor (FakeVmm)", () => {
  it.live(
    "status, three clients at once, attach with replay, one typist, a client gone mid-turn, cancel, timeout, stop",
    () => {
      const home = tempDir("abox-home-")
      return Effect.gen(function* () {
        const ready = yield* Deferred.make<{ sessionId: string; socket: string }>()
        const supervisor = yield* supervise(open({ source: source(), name: "sup" }), {
          onReady: (info) => Deferred.succeed(ready, info)
        }).pipe(Effect.fork)
        const { sessionId, socket } = yield* Deferred.await(ready)

        // the socket: 0600, in the session directory
        expect(socket).toBe(controlSocketPath(path.join(home, "sessions", sessionId)))
        expect(fs.statSync(socket).mode & 0o777).toBe(0o600)
        const info = yield* status("sup")
        expect(info).toMatchObject({ sessionId, pid: process.pid, clients: 1, turn: null, version: 1 })

        // three clients at once: the turns run one at a time, each client gets its own output
        const three = yield* Effect.all(
          ["one", "two", "three"].map((word) =>
            exec("sup", { text: `echo ${word}; sleep 0.2; echo ${word}-end` })
          ),
          { concurrency: "unbounded" }
        )
        expect(three.map(stdoutOf)).toEqual(["one\none-end\n", "two\ntwo-end\n", "three\nthree-end\n"])
        expect(three.map((r) => endOf(r)?.exitCode)).toEqual([0, 0, 0])
        const turnNumbers = three.map((r) => endOf(r)?.turn)
        expect(new Set(turnNumbers).size).toBe(3)

        // env and cwd make a shell turn; the exit status comes back
        const envTurn = yield* exec("sup", {
          text: "echo $GREETING; pwd; exit 3",
          env: { GREETING: "it's me" },
          cwd: "/"
        })
        expect(stdoutOf(envTurn)).toBe("it's me\n/\n")
        expect(endOf(envTurn)).toMatchObject({ exitCode: 3, cancelled: false })
        const badEnv = yield* exec("sup", { text: "true", env: { "A-B": "x" } })
        expect(badEnv.at(-1)).toMatchObject({ type: "error", error: { _tag: "ControlError" } })
        // a prompt turn is the model agent's: env and cwd belong to shell turns
        const promptWithCwd = yield* exec("sup", { text: "hi", mode: "prompt", cwd: "/" })
        expect(promptWithCwd.at(-1)).toMatchObject({ type: "error", error: { _tag: "ControlError" } })

        // repository operations: a host path must be absolute (the supervisor's cwd is not the
        // client's); a diff larger than one line comes back in pieces, whole
        const relative = yield* Effect.scoped(
          Effect.gen(function* () {
            const connection = yield* connect("sup")
            yield* connection.send({
              type: "repo",
              request: { op: "copy_out", guestPath: "README.md", hostPath: "rel.txt" }
            })
            return yield* connection.next
          })
        )
        expect(relative).toMatchObject(
          Option.some({ type: "error", error: { _tag: "ControlError", reason: "bad request" } })
        )
        const big = yield* exec("sup", {
          text: "i=0; while [ $i -lt 60000 ]; do echo line-$i; i=$((i+1)); done > big.txt"
        })
        expect(endOf(big)).toMatchObject({ exitCode: 0 })
        const { text } = yield* remoteRepo("sup", { op: "diff", paths: ["big.txt"] })
        expect(text.length).toBeGreaterThan(2 * REPO_CHUNK)
        expect(text).toContain("+line-0\n")
        expect(text).toContain("+line-59999\n")
        expect(text.split("\n").filter((l) => l.startsWith("+line-"))).toHaveLength(60000)

        // timeout: the turn is cancelled, timedOut says why
        const slow = yield* exec("sup", { text: "sleep 30", timeoutMs: 300 })
        expect(endOf(slow)).toMatchObject({ cancelled: true, timedOut: true })

        // a client that goes away mid-turn: the turn goes on; an attach sees its start (replayed) and end
        yield* Effect.scoped(
          Effect.gen(function* () {
            const connection = yield* connect("sup")
            yield* connection.send({ type: "turn", text: "echo early; sleep 0.5; echo late" })
            // wait for the start, then leave without a word
            yield* connection.replies.pipe(
              Stream.takeUntil((r) => r.type === "event"),
              Stream.runDrain
            )
          })
        )
        const watched = yield* Effect.scoped(
          Effect.gen(function* () {
            const watcher = yield* connect("sup")
            yield* watcher.send({ type: "attach", typist: false })
            return Chunk.toArray(
              yield* watcher.replies.pipe(
                Stream.takeUntil((r) => r.type === "turn_end"),
                Stream.runCollect
              )
            )
          })
        )
        expect(watched[0]).toEqual({ type: "attached", typist: false, lines: "prompt" })
        expect(watched[1]).toMatchObject({ type: "turn_started", text: "echo early; sleep 0.5; echo late" })
        expect(stdoutOf(watched)).toBe("early\nlate\n")
        expect(endOf(watched)).toMatchObject({ exitCode: 0 })

        // one typist: the first attach that asks types, the second watches and is refused a turn;
        // the typist's turn is seen by both, marked as its own for the typist only
        yield* Effect.scoped(
          Effect.gen(function* () {
            const typist = yield* connect("sup")
            yield* typist.send({ type: "attach", typist: true })
            expect(yield* typist.next).toEqual(
              Option.some({ type: "attached", typist: true, lines: "prompt" })
            )
            const other = yield* connect("sup")
            yield* other.send({ type: "attach", typist: true })
            expect(yield* other.next).toEqual(
              Option.some({ type: "attached", typist: false, lines: "prompt" })
            )
            yield* other.send({ type: "turn", text: "echo refused" })
            expect(yield* other.next).toMatchObject(
              Option.some({ type: "error", error: { _tag: "ControlError" } })
            )
            yield* typist.send({ type: "turn", text: "echo typed" })
            const typistSaw = Chunk.toArray(
              yield* typist.replies.pipe(
                Stream.takeUntil((r) => r.type === "turn_end"),
                Stream.runCollect
              )
            )
            const otherSaw = Chunk.toArray(
              yield* other.replies.pipe(
                Stream.takeUntil((r) => r.type === "turn_end"),
                Stream.runCollect
              )
            )
            expect(typistSaw[0]).toMatchObject({ type: "turn_started", text: "echo typed", mine: true })
            expect(otherSaw[0]).toMatchObject({ type: "turn_started", text: "echo typed" })
            expect(otherSaw[0]).not.toHaveProperty("mine")
            expect(stdoutOf(typistSaw)).toBe("typed\n")
            expect(stdoutOf(otherSaw)).toBe("typed\n")
            // the typist cancels its own running turn
            yield* typist.send({ type: "turn", text: "sleep 30" })
            yield* typist.replies.pipe(
              Stream.takeUntil((r) => r.type === "turn_started"),
              Stream.runDrain
            )
            yield* typist.send({ type: "cancel" })
            const cancelled = Chunk.toArray(
              yield* typist.replies.pipe(
                Stream.takeUntil((r) => r.type === "turn_end"),
                Stream.runCollect
              )
            )
            expect(endOf(cancelled)).toMatchObject({ cancelled: true, timedOut: false })
          })
        )

        // bad input on the socket: a line that is not a request gets a typed error; a line past the
        // bound ends that connection with one too; the supervisor goes on serving
        const raw = (payload: string | Buffer) =>
          Effect.async<string>((resume) => {
            const c = net.connect(socket)
            let got = ""
            c.on("data", (d: Buffer) => (got += d.toString()))
            c.on("close", () => resume(Effect.succeed(got)))
            c.on("error", () => undefined)
            c.write(payload)
          })
        expect(JSON.parse(yield* raw('{"type":"launch"}\n'))).toMatchObject({
          type: "error",
          error: { _tag: "ControlError", reason: "bad request" }
        })
        expect(JSON.parse(yield* raw(Buffer.alloc(3 * 1024 * 1024, 0x61)))).toMatchObject({
          type: "error",
          error: { _tag: "ControlError", message: "control socket: a line longer than 2097152 bytes" }
        })
        // a flood of newlines after a turn request: the first empty line is refused with a typed
        // error and the connection closed (not a loop over millions of empty lines); the turn goes on
        const flooded = (yield* raw(
          Buffer.concat([
            Buffer.from('{"type":"turn","text":"sleep 1; echo flood-end"}\n'),
            Buffer.alloc(8 << 20, 10)
          ])
        ))
          .split("\n")
          .filter((line) => line !== "")
          .map((line) => JSON.parse(line) as ControlReply)
        expect(flooded.at(-1)).toMatchObject({
          type: "error",
          error: {
            _tag: "ControlError",
            reason: "bad request",
            message: expect.stringContaining("not a control request")
          }
        })
        expect(flooded.some((r) => r.type === "turn_end")).toBe(false)
        expect((yield* status("sup")).sessionId).toBe(sessionId)

        // stop: the requester hears "stopping", then its connection ends only once Close is done
        const result = yield* stop("sup")
        expect(result).toEqual({ how: "stopped", pid: process.pid })
        expect(yield* Fiber.join(supervisor)).toBe("stop")
        expect(fs.existsSync(socket)).toBe(false)
        expect(yield* statusIfRunning("sup")).toEqual(Option.none())
        const notRunning = yield* exec("sup", { text: "true" }).pipe(Effect.flip)
        expect(notRunning._tag).toBe("SessionNotRunning")
      }).pipe(Effect.provide(layerFor(home)))
    },
    120_000
  )

  it.live(
    "exec -t: a tty turn over the control socket; input, resize and signal lines from its own connection",
    () => {
      const home = tempDir("abox-home-")
      return Effect.gen(function* () {
        const ready = yield* Deferred.make<{ sessionId: string; socket: string }>()
        const supervisor = yield* supervise(open({ source: source(), name: "tty" }), {
          onReady: (info) => Deferred.succeed(ready, info)
        }).pipe(Effect.fork)
        yield* Deferred.await(ready)
        const run = (
          text: string,
          drive: (
            send: (line: ControlRequest) => Effect.Effect<void, unknown>
          ) => Effect.Effect<void, unknown>
        ) =>
          Effect.scoped(
            Effect.gen(function* () {
              const connection = yield* connect("tty")
              yield* connection.send({ type: "turn", text, tty: { rows: 25, cols: 90, term: "xterm" } })
              const replies: Array<ControlReply> = []
              let driven = false
              yield* connection.replies.pipe(
                Stream.takeUntil((reply) => reply.type === "turn_end" || reply.type === "error"),
                Stream.runForEach((reply) =>
                  Effect.gen(function* () {
                    replies.push(reply)
                    if (!driven && stdoutOf(replies).includes("ready")) {
                      driven = true
                      yield* drive(connection.send)
                    }
                  })
                )
              )
              return replies
            })
          )
        const typed = yield* run(
          'stty size; echo "term=$TERM"; echo ready; read line; stty size; echo "got=$line"',
          (send) =>
            Effect.gen(function* () {
              yield* send({ type: "resize", rows: 40, cols: 100 })
              yield* realSleep(300)
              yield* send({ type: "input", data: Buffer.from("abc\r").toString("base64") })
            })
        )
        expect(stdoutOf(typed)).toMatch(/^25 90\r\nterm=xterm\r\nready\r\n/)
        expect(stdoutOf(typed)).toContain("40 100\r\ngot=abc\r\n")
        expect(endOf(typed)).toMatchObject({ exitCode: 0, cancelled: false })
        // ^C typed is the line discipline's SIGINT; a signal line reaches the command too
        const interrupted = yield* run("echo ready; sleep 30", (send) =>
          send({ type: "input", data: Buffer.from([3]).toString("base64") })
        )
        expect(endOf(interrupted)).toMatchObject({ exitCode: 130 })
        const signalled = yield* run("echo ready; sleep 30", (send) =>
          send({ type: "signal", signal: "SIGTERM" })
        )
        expect(endOf(signalled)).toMatchObject({ exitCode: 143 })
        yield* stop("tty")
        expect(yield* Fiber.join(supervisor)).toBe("stop")
      }).pipe(Effect.provide(layerFor(home)))
    },
    120_000
  )

  it.effect(
    "the idle timeout (TestClock): no client and no turn for that long closes the session; a client resets it",
    () => {
      const home = tempDir("abox-home-")
      return Effect.gen(function* () {
        const ready = yield* Deferred.make<void>()
        const fiber = yield* supervise(open({ source: source(), name: "idle" }), {
          idleTimeout: "10 minutes",
          onReady: () => Deferred.succeed(ready, undefined)
        }).pipe(Effect.fork)
        yield* Deferred.await(ready)
        const settle = Effect.gen(function* () {
          // the idle watcher registers its sleep from another fiber; give it a moment
          for (let i = 0; i < 50 && (yield* TestClock.sleeps()).length === 0; i++) yield* realSleep(10)
        })
        yield* settle
        yield* TestClock.adjust("6 minutes")
        expect(yield* Fiber.poll(fiber)).toEqual(Option.none())
        // a client comes and goes: the idle clock starts again when it leaves
        expect((yield* status("idle")).idleTimeoutMs).toBe(600_000)
        yield* realSleep(50)
        yield* settle
        yield* TestClock.adjust("6 minutes")
        expect(yield* Fiber.poll(fiber)).toEqual(Option.none())
        yield* TestClock.adjust("5 minutes")
        expect(yield* Fiber.join(fiber)).toBe("idle")
      }).pipe(Effect.provide(layerFor(home)))
    },
    120_000
  )

  it.live(
    "a stale control socket (its supervisor SIGKILLed) is refused to clients and replaced by the next supervisor",
    () => {
      const home = tempDir("abox-home-")
      return Effect.gen(function* () {
        // make the session, then leave a socket file nobody listens on, as a killed supervisor does
        const id = yield* Effect.scoped(Effect.map(open({ source: source(), name: "stale" }), (s) => s.id))
        const socket = controlSocketPath(path.join(home, "sessions", id))
        yield* Effect.promise(
          () =>
            new Promise<void>((resolve) => {
              const child = spawn(process.execPath, [
                "-e",
                `require("net").createServer().listen(${JSON.stringify(socket)}, () => console.log("up"))`
              ])
              child.stdout.once("data", () => {
                child.kill("SIGKILL")
                child.once("exit", () => resolve())
              })
            })
        )
        expect(fs.existsSync(socket)).toBe(true)
        const refused = yield* status("stale").pipe(Effect.flip)
        expect(refused._tag).toBe("SessionNotRunning")
        const ready = yield* Deferred.make<void>()
        const fiber = yield* supervise(resume("stale"), {
          onReady: () => Deferred.succeed(ready, undefined)
        }).pipe(Effect.fork)
        yield* Deferred.await(ready)
        expect((yield* status("stale")).sessionId).toBe(id)
        yield* stop("stale")
        expect(yield* Fiber.join(fiber)).toBe("stop")
      }).pipe(Effect.provide(layerFor(home)))
    },
    120_000
  )

  it.scopedLive(
    "forward: a host port reaches 127.0.0.1:<port> in the guest (here the fake guest is this host) both ways, ends passed on; a closed port is refused",
    () => {
      const home = tempDir("abox-home-")
      return Effect.gen(function* () {
        // the "guest" service: reads until EOF, answers in upper case, then ends
        const service = yield* Effect.acquireRelease(
          Effect.async<net.Server>((resume) => {
            const server = net.createServer({ allowHalfOpen: true }, (socket) => {
              let got = ""
              socket.on("data", (d: Buffer) => (got += d.toString()))
              socket.on("end", () => socket.end(got.toUpperCase()))
            })
            server.listen(0, "127.0.0.1", () => resume(Effect.succeed(server)))
          }),
          (server) => Effect.sync(() => server.close())
        )
        const servicePort = (service.address() as net.AddressInfo).port
        const ready = yield* Deferred.make<void>()
        const supervisor = yield* supervise(open({ source: source(), name: "fwd" }), {
          onReady: () => Deferred.succeed(ready, undefined)
        }).pipe(Effect.fork)
        yield* Deferred.await(ready)

        const listening = yield* Deferred.make<number>()
        const refused: Array<string> = []
        const forwarding = yield* forward("fwd", servicePort, 0, {
          onListening: (port) => Deferred.succeed(listening, port),
          onRefused: (error) => Effect.sync(() => refused.push(error._tag))
        }).pipe(Effect.scoped, Effect.fork)
        const hostPort = yield* Deferred.await(listening)
        const roundTrip = (port: number, text: string) =>
          Effect.async<string>((resume) => {
            const socket = net.connect({ port, host: "127.0.0.1", allowHalfOpen: true })
            let got = ""
            socket.on("data", (d: Buffer) => (got += d.toString()))
            socket.on("close", () => resume(Effect.succeed(got)))
            socket.on("error", () => undefined)
            socket.end(text)
          })
        // two connections at once, each its own channel; a big one crosses many frames and windows
        const big = "x".repeat(3 * 1024 * 1024)
        const [small, large] = yield* Effect.all(
          [roundTrip(hostPort, "hello forward"), roundTrip(hostPort, big)],
          {
            concurrency: 2
          }
        )
        expect(small).toBe("HELLO FORWARD")
        expect(large.length).toBe(big.length)
        expect(large).toBe(big.toUpperCase())

        // a port nobody listens on in the guest: the connection is closed, the refusal reported
        const closedPort = yield* Effect.async<number>((resume) => {
          const probe = net.createServer().listen(0, "127.0.0.1", () => {
            const port = (probe.address() as net.AddressInfo).port
            probe.close(() => resume(Effect.succeed(port)))
          })
        })
        const listening2 = yield* Deferred.make<number>()
        const forwarding2 = yield* forward("fwd", closedPort, 0, {
          onListening: (port) => Deferred.succeed(listening2, port),
          onRefused: (error) => Effect.sync(() => refused.push(error._tag))
        }).pipe(Effect.scoped, Effect.fork)
        expect(yield* roundTrip(yield* Deferred.await(listening2), "anyone?")).toBe("")
        expect(refused).toEqual(["ForwardRefused"])

        // the forwards end when the session stops
        yield* stop("fwd")
        expect(yield* Fiber.join(supervisor)).toBe("stop")
        yield* Fiber.join(forwarding)
        yield* Fiber.join(forwarding2)
      }).pipe(Effect.provide(layerFor(home)))
    },
    120_000
  )

  it.live(
    "stop of a supervisor that does not finish takes the bounded kill path: SIGTERM, then SIGKILL",
    () => {
      const home = tempDir("abox-home-")
      return Effect.gen(function* () {
        const id = yield* Effect.scoped(Effect.map(open({ source: source(), name: "hang" }), (s) => s.id))
        const socket = controlSocketPath(path.join(home, "sessions", id))
        /** a stand-in supervisor: answers stop with `pid` and then never ends the connection */
        const hanging = (pid: number) =>
          Effect.acquireRelease(
            Effect.async<net.Server>((resume) => {
              const server = net.createServer((c) => {
                c.once("data", () => c.write(JSON.stringify({ type: "stopping", pid }) + "\n"))
              })
              server.listen(socket, () => resume(Effect.succeed(server)))
            }),
            (server) => Effect.sync(() => server.close())
          )
        const child = (ignoreTerm: boolean) =>
          Effect.acquireRelease(
            Effect.async<ChildProcess>((resume) => {
              const p = spawn(process.execPath, [
                "-e",
                `${ignoreTerm ? 'process.on("SIGTERM", () => {});' : ""} console.log("up"); setInterval(() => {}, 1000)`
              ])
              p.stdout!.once("data", () => resume(Effect.succeed(p)))
            }),
            (p) => Effect.sync(() => p.kill("SIGKILL"))
          )
        const polite = yield* child(false)
        yield* Effect.scoped(
          Effect.gen(function* () {
            yield* hanging(polite.pid!)
            const result = yield* stop("hang", { timeout: "300 millis", terminateWait: "5 seconds" })
            expect(result).toEqual({ how: "terminated", pid: polite.pid })
          })
        )
        const stubborn = yield* child(true)
        yield* Effect.scoped(
          Effect.gen(function* () {
            yield* hanging(stubborn.pid!)
            const result = yield* stop("hang", { timeout: "300 millis", terminateWait: "500 millis" })
            expect(result).toEqual({ how: "killed", pid: stubborn.pid })
          })
        )
        expect(
          stubborn.signalCode ??
            (yield* Effect.async<string | null>((resume) => {
              if (stubborn.exitCode !== null || stubborn.signalCode !== null)
                resume(Effect.succeed(stubborn.signalCode))
              else stubborn.once("exit", (_code, signal) => resume(Effect.succeed(signal)))
            }))
        ).toBe("SIGKILL")
      }).pipe(Effect.scoped, Effect.provide(layerFor(home)))
    },
    120_000
  )

  it.live(
    "a cp whose client goes away mid-copy is stopped there: the guest's tar ends and nothing stays at the destination",
    () => {
      const home = tempDir("abox-home-")
      return Effect.gen(function* () {
        const ready = yield* Deferred.make<{ sessionId: string; socket: string }>()
        yield* supervise(open({ source: source(), name: "gone" }), {
          onReady: (info) => Deferred.succeed(ready, info)
        }).pipe(Effect.fork)
        yield* Deferred.await(ready)
        // under cp's 8 GiB bound, sparse in the guest, so the copy would write all of it
        const name = `slow-${process.pid}-${Date.now()}.bin`
        expect(endOf(yield* exec("gone", { text: `truncate -s 7G ${name}` }))).toMatchObject({ exitCode: 0 })
        const out = tempDir("abox-cp-gone-")
        yield* Effect.scoped(
          Effect.gen(function* () {
            const connection = yield* connect("gone")
            yield* connection.send({
              type: "repo",
              request: { op: "copy_out", guestPath: name, hostPath: path.join(out, "copy.bin") }
            })
            yield* realSleep(1000)
            expect(processesMentioning(name).length).toBeGreaterThan(0)
          })
        )
        // the client is gone: within a moment the guest's tar is stopped and the staging removed
        yield* realSleep(2000)
        expect(processesMentioning(name)).toEqual([])
        expect(fs.readdirSync(out)).toEqual([])
        yield* stop("gone")
      }).pipe(Effect.scoped, Effect.provide(layerFor(home)))
    },
    120_000
  )
})
