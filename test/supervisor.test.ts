/**
 * The detached supervisor's control plane (ControlRpcs over the control socket) against FakeVmm (the real guest agent as a host
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
import { REPO_CHUNK, type TurnRequest } from "../src/protocol/Control.js"
import type { AttachOutput, TurnOutput } from "../src/services/ControlRpc.js"
import {
  connect,
  forward,
  remoteSession,
  remoteTurn,
  status,
  statusIfRunning,
  stop
} from "../src/programs/detached.js"
import type { TtyControl } from "../src/services/GuestRpc.js"
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

/** what a turn or an attach gave a client: its elements, then the error that ended it, if one did */
type Item = TurnOutput | AttachOutput | { readonly _tag: "Error"; readonly error: { readonly _tag: string } }

/** one exec: every element until the turn's end (or its error) */
const exec = (ref: string, request: TurnRequest) =>
  Effect.scoped(
    Effect.gen(function* () {
      const { client } = yield* connect(ref)
      return Chunk.toArray(
        yield* client.Turn(request).pipe(
          Stream.map((item): Item => item),
          Stream.catchAll((error) => Stream.make<Array<Item>>({ _tag: "Error", error })),
          Stream.runCollect
        )
      )
    })
  )

const stdoutOf = (items: ReadonlyArray<Item>) =>
  items.map((r) => (r._tag === "Event" && r.event.kind === "stdout" ? r.event.data : "")).join("")
const endOf = (items: ReadonlyArray<Item>) => items.find((r) => r._tag === "Ended")

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
        expect(info).toMatchObject({ sessionId, pid: process.pid, clients: 1, turn: null, version: 2 })

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
        expect(badEnv.at(-1)).toMatchObject({ _tag: "Error", error: { _tag: "ControlError" } })
        // a prompt turn is the model agent's: env and cwd belong to shell turns
        const promptWithCwd = yield* exec("sup", { text: "hi", mode: "prompt", cwd: "/" })
        expect(promptWithCwd.at(-1)).toMatchObject({ _tag: "Error", error: { _tag: "ControlError" } })

        // repository operations: a host path must be absolute (the supervisor's cwd is not the
        // client's); a diff larger than one line comes back in pieces, whole
        const relative = yield* Effect.scoped(
          Effect.flatMap(connect("sup"), ({ client }) =>
            client.CopyOut({ guestPath: "README.md", hostPath: "rel.txt" }).pipe(Effect.exit)
          )
        )
        expect(String(relative)).toContain("not an absolute host path: rel.txt")
        const big = yield* exec("sup", {
          text: "i=0; while [ $i -lt 60000 ]; do echo line-$i; i=$((i+1)); done > big.txt"
        })
        expect(endOf(big)).toMatchObject({ exitCode: 0 })
        const text = yield* remoteSession("sup").diff({ paths: ["big.txt"] })
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
            const { client } = yield* connect("sup")
            // wait for the first event, then leave without a word (no Cancel)
            yield* client.Turn({ text: "echo early; sleep 0.5; echo late" }).pipe(
              Stream.takeUntil((r) => r._tag === "Event"),
              Stream.runDrain
            )
          })
        )
        const watched = yield* Effect.scoped(
          Effect.gen(function* () {
            const { client } = yield* connect("sup")
            return Chunk.toArray(
              yield* client.Attach({ typist: false }).pipe(
                Stream.takeUntil((r) => r._tag === "Ended"),
                Stream.runCollect
              )
            )
          })
        )
        expect(watched[0]).toEqual({ _tag: "Attached", typist: false, lines: "prompt" })
        expect(watched[1]).toMatchObject({ _tag: "Started", text: "echo early; sleep 0.5; echo late" })
        expect(stdoutOf(watched)).toBe("early\nlate\n")
        expect(endOf(watched)).toMatchObject({ exitCode: 0 })

        // one typist: the first attach that asks types, the second watches and is refused a turn;
        // the typist's turn is seen by both, marked as its own for the typist only
        yield* Effect.scoped(
          Effect.gen(function* () {
            const typist = (yield* connect("sup")).client
            const typistSees = yield* Stream.toPull(typist.Attach({ typist: true }))
            const other = (yield* connect("sup")).client
            const otherSees = yield* Stream.toPull(other.Attach({ typist: true }))
            /** the elements a watcher sees, up to and including `until` */
            const upTo = (pull: typeof typistSees, until: (item: AttachOutput) => boolean) =>
              Effect.gen(function* () {
                const seen: Array<AttachOutput> = []
                while (!seen.some(until)) seen.push(...(yield* pull))
                return seen
              })
            expect(yield* upTo(typistSees, (r) => r._tag === "Attached")).toEqual([
              { _tag: "Attached", typist: true, lines: "prompt" }
            ])
            expect(yield* upTo(otherSees, (r) => r._tag === "Attached")).toEqual([
              { _tag: "Attached", typist: false, lines: "prompt" }
            ])
            const refusedTurn = yield* other.Type({ text: "echo refused" }).pipe(Effect.flip)
            expect(refusedTurn).toMatchObject({ _tag: "ControlError", reason: "not typist" })
            yield* typist.Type({ text: "echo typed" })
            const typistSaw = yield* upTo(typistSees, (r) => r._tag === "Ended")
            const otherSaw = yield* upTo(otherSees, (r) => r._tag === "Ended")
            expect(typistSaw[0]).toMatchObject({ _tag: "Started", text: "echo typed", mine: true })
            expect(otherSaw[0]).toMatchObject({ _tag: "Started", text: "echo typed" })
            expect(otherSaw[0]).not.toHaveProperty("mine")
            expect(stdoutOf(typistSaw)).toBe("typed\n")
            expect(stdoutOf(otherSaw)).toBe("typed\n")
            // the typist cancels its own running turn; the watcher's Cancel does nothing to it
            yield* typist.Type({ text: "sleep 30" })
            yield* upTo(typistSees, (r) => r._tag === "Started")
            yield* other.Cancel()
            yield* typist.Cancel()
            const cancelled = yield* upTo(typistSees, (r) => r._tag === "Ended")
            expect(endOf(cancelled)).toMatchObject({ cancelled: true, timedOut: false })
          })
        )

        // bad input on the socket: a connection that does not begin with this version's hello
        // is refused with a typed error (also in the shape a v1 client reads) and closed; so is
        // a line past the bound, and a flood of newlines after the hello (not a reply per line);
        // the supervisor goes on serving
        const raw = (payload: string | Buffer) =>
          Effect.async<string>((resume) => {
            const c = net.connect(socket)
            let got = ""
            c.on("data", (d: Buffer) => (got += d.toString()))
            c.on("close", () => resume(Effect.succeed(got)))
            c.on("error", () => undefined)
            c.write(payload)
          })
        expect(JSON.parse(yield* raw('{"type":"status"}\n'))).toMatchObject({
          type: "error",
          error: { _tag: "ControlVersionMismatch", version: 2, peer: null }
        })
        expect(JSON.parse(yield* raw('{"type":"hello","version":1}\n'))).toMatchObject({
          type: "refused",
          error: { _tag: "ControlVersionMismatch", version: 2, peer: 1 }
        })
        expect(yield* raw(Buffer.alloc(5 * 1024 * 1024, 0x61))).toBe("")
        const hello = '{"type":"hello","version":2}\n'
        // after the hello, a line that is not a message, or past the bound of a line: the client is
        // told why (a Defect, which fails its calls) and the connection is closed
        const welcome = '{"type":"welcome","version":2}'
        const refusal = (text: string) => {
          const lines = text.split("\n")
          expect([lines[0], lines.at(-1)]).toEqual([welcome, ""])
          // the last line before the close (an Attach's first element may come before it)
          return JSON.parse(lines.at(-2)!) as { _tag: string; defect: string }
        }
        const flooded = yield* raw(Buffer.concat([Buffer.from(hello), Buffer.alloc(8 << 20, 10)]))
        expect(refusal(flooded)).toMatchObject({
          _tag: "Defect",
          defect: expect.stringContaining("not a control message")
        })
        const long = yield* raw(Buffer.concat([Buffer.from(hello), Buffer.alloc(5 * 1024 * 1024, 0x61)]))
        expect(refusal(long)).toMatchObject({
          _tag: "Defect",
          defect: expect.stringContaining("not a control message")
        })
        // a request of a tag the control plane does not have, and an id sent twice while in flight
        const request = (id: string, tag: string, payload: unknown) =>
          `${JSON.stringify({ _tag: "Request", id, tag, payload, headers: [] })}\n`
        expect(refusal(yield* raw(hello + request("1", "Shell", {})))).toMatchObject({
          defect: expect.stringContaining("not a request of the control plane: Shell")
        })
        const twice = request("7", "Attach", { typist: false })
        expect(refusal(yield* raw(hello + twice + twice)).defect).toContain("request id 7 is in use")
        expect((yield* status("sup")).sessionId).toBe(sessionId)

        // a Stop that suspends, where the VM cannot be saved (FakeVmm): refused with its typed
        // error, and the session runs on
        const refused = yield* stop("sup", { suspend: true }).pipe(Effect.flip)
        expect(refused._tag).toBe("SnapshotUnsupported")
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
    "exec -t: a tty turn over the control socket; Input, Resize and Signal from its own connection",
    () => {
      const home = tempDir("abox-home-")
      return Effect.gen(function* () {
        const ready = yield* Deferred.make<{ sessionId: string; socket: string }>()
        const supervisor = yield* supervise(open({ source: source(), name: "tty" }), {
          onReady: (info) => Deferred.succeed(ready, info)
        }).pipe(Effect.fork)
        yield* Deferred.await(ready)
        const run = (text: string, drive: ReadonlyArray<TtyControl>) =>
          Effect.gen(function* () {
            // the controls go once the command said it is ready
            const ready = yield* Deferred.make<void>()
            const controls = Stream.fromEffect(Deferred.await(ready)).pipe(
              Stream.flatMap(() => Stream.fromIterable(drive)),
              Stream.tap(() => realSleep(300))
            )
            const items: Array<Item> = []
            yield* remoteTurn("tty", { text, tty: { rows: 25, cols: 90, term: "xterm" } }, controls).pipe(
              Stream.runForEach((item) =>
                Effect.gen(function* () {
                  items.push(item)
                  if (stdoutOf(items).includes("ready")) yield* Deferred.succeed(ready, undefined)
                })
              )
            )
            return items
          })
        const typed = yield* run(
          'stty size; echo "term=$TERM"; echo ready; read line; stty size; echo "got=$line"',
          [
            { _tag: "Resize", rows: 40, cols: 100 },
            { _tag: "Input", bytes: Buffer.from("abc\r") }
          ]
        )
        expect(stdoutOf(typed)).toMatch(/^25 90\r\nterm=xterm\r\nready\r\n/)
        expect(stdoutOf(typed)).toContain("40 100\r\ngot=abc\r\n")
        expect(endOf(typed)).toMatchObject({ exitCode: 0, cancelled: false })
        // ^C typed is the line discipline's SIGINT; a signal line reaches the command too
        const interrupted = yield* run("echo ready; sleep 30", [{ _tag: "Input", bytes: Buffer.from([3]) }])
        expect(endOf(interrupted)).toMatchObject({ exitCode: 130 })
        const signalled = yield* run("echo ready; sleep 30", [{ _tag: "Signal", signal: "SIGTERM" }])
        expect(endOf(signalled)).toMatchObject({ exitCode: 143 })
        yield* stop("tty")
        expect(yield* Fiber.join(supervisor)).toBe("stop")
      }).pipe(Effect.provide(layerFor(home)))
    },
    120_000
  )

  it.live(
    "a client that asked to Stop and then stays silent (no pings) does not hold the session's close: the supervisor ends and closes its connection",
    () => {
      const home = tempDir("abox-home-")
      return Effect.gen(function* () {
        const ready = yield* Deferred.make<{ socket: string }>()
        const fiber = yield* supervise(open({ source: source(), name: "quiet" }), {
          onReady: (info) => Deferred.succeed(ready, info)
        }).pipe(Effect.fork)
        const { socket } = yield* Deferred.await(ready)
        const stopRequest = JSON.stringify({
          _tag: "Request",
          id: "1",
          tag: "Stop",
          payload: {},
          headers: []
        })
        const closedByServer = yield* Effect.promise(
          () =>
            new Promise<boolean>((resolve) => {
              const client = net.connect(socket, () => client.write(`{"type":"hello","version":2}\n`))
              // the Stop once welcomed, its Stopping acknowledged, as RpcClient does; then nothing
              // more (no ping): the connection is only closed by the supervisor
              let replies = ""
              client.on("data", (data) => {
                const first = replies === ""
                replies += String(data)
                if (first) client.write(`${stopRequest}\n`)
                else if (replies.includes('"Stopping"') && !replies.includes("acked"))
                  client.write(
                    `${JSON.stringify({ _tag: "Ack", requestId: "1" })}\n`,
                    () => (replies += "acked")
                  )
              })
              client.once("close", () => resolve(true))
              client.once("error", () => resolve(false))
            })
        ).pipe(Effect.fork)
        expect(yield* Fiber.join(fiber).pipe(Effect.timeout("30 seconds"))).toBe("stop")
        expect(yield* Fiber.join(closedByServer).pipe(Effect.timeout("30 seconds"))).toBe(true)
      }).pipe(Effect.provide(layerFor(home)))
    },
    120_000
  )

  it.live(
    "a VM that ends by itself (SIGKILLed) ends its supervisor at once (guest-gone): the host never outlives its VM",
    () => {
      const home = tempDir("abox-home-")
      return Effect.gen(function* () {
        const ready = yield* Deferred.make<void>()
        const fiber = yield* supervise(open({ source: source(), name: "dies" }), {
          onReady: () => Deferred.succeed(ready, undefined)
        }).pipe(Effect.fork)
        yield* Deferred.await(ready)
        // no client, no turn: nothing else would notice the VM is gone
        const guests = processesMentioning(home)
        expect(guests.length).toBeGreaterThan(0)
        for (const pid of guests) process.kill(pid, "SIGKILL")
        expect(yield* Fiber.join(fiber).pipe(Effect.timeout("30 seconds"))).toBe("guest-gone")
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
    "a client of this version and a supervisor of the old JSON-lines protocol part with ControlVersionMismatch, not a hang",
    () => {
      const home = tempDir("abox-home-")
      return Effect.gen(function* () {
        const id = yield* Effect.scoped(Effect.map(open({ source: source(), name: "old" }), (s) => s.id))
        const socket = controlSocketPath(path.join(home, "sessions", id))
        // a v1 supervisor: any first line that is not one of its requests gets its error line
        yield* Effect.acquireRelease(
          Effect.async<net.Server>((resume) => {
            const server = net.createServer((c) => {
              c.once("data", () =>
                c.write(
                  JSON.stringify({
                    type: "error",
                    error: { _tag: "ControlError", reason: "bad request", message: "not a control request" }
                  }) + "\n"
                )
              )
            })
            server.listen(socket, () => resume(Effect.succeed(server)))
          }),
          (server) => Effect.sync(() => server.close())
        )
        const refused = yield* status("old").pipe(Effect.flip, Effect.timeout("20 seconds"))
        expect(refused).toMatchObject({ _tag: "ControlVersionMismatch", version: 2, peer: null })
        expect(refused.message).toContain("older control protocol")
        const turn = yield* exec("old", { text: "true" }).pipe(Effect.flip, Effect.timeout("20 seconds"))
        expect(turn._tag).toBe("ControlVersionMismatch")
      }).pipe(Effect.scoped, Effect.provide(layerFor(home)))
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
        /** a stand-in supervisor: welcomes, answers Stop with `pid` and then never ends the connection */
        const hanging = (pid: number) =>
          Effect.acquireRelease(
            Effect.async<net.Server>((resume) => {
              const server = net.createServer((c) => {
                let got = ""
                let welcomed = false
                c.on("data", (d: Buffer) => {
                  got += d.toString()
                  for (let nl = got.indexOf("\n"); nl >= 0; nl = got.indexOf("\n")) {
                    const line = JSON.parse(got.slice(0, nl)) as { _tag?: string; tag?: string; id?: string }
                    got = got.slice(nl + 1)
                    if (!welcomed) {
                      welcomed = true
                      c.write(JSON.stringify({ type: "welcome", version: 2 }) + "\n")
                    } else if (line._tag === "Request" && line.tag === "Stop")
                      c.write(
                        JSON.stringify({
                          _tag: "Chunk",
                          requestId: line.id,
                          values: [{ _tag: "Stopping", pid }]
                        }) + "\n"
                      )
                  }
                })
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
            const { client } = yield* connect("gone")
            yield* client
              .CopyOut({ guestPath: name, hostPath: path.join(out, "copy.bin") })
              .pipe(Effect.forkScoped)
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
