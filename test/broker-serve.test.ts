import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as FileSystem from "@effect/platform/FileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Cause from "effect/Cause"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Logger from "effect/Logger"
import * as LogLevel from "effect/LogLevel"
import * as Queue from "effect/Queue"
import * as Schedule from "effect/Schedule"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import { type HttpsBrokerOptions, makeHttpsBroker } from "../src/broker/HttpsBrokerLive.js"
import { readBrokerLog } from "../src/broker/log.js"
import { decodePolicy } from "../src/broker/policy.js"
import type { TunnelRequest } from "../src/services/GuestRpc.js"
import { clientHelloBytes, inMemoryTunnel } from "./support/brokerHarness.js"

const NAME = "key.test"

/** a session broker for NAME (a credential host) serving a queue of tunnels in its own scope */
const brokerSession = (options: HttpsBrokerOptions) =>
  Effect.gen(function* () {
    const fs = yield* FileSystem.FileSystem
    const sessionDir = yield* fs.makeTempDirectoryScoped()
    process.env.ABOX_SERVE_TEST_KEY = "serve-test-key"
    const policy = yield* decodePolicy({
      format: 1,
      allow: [{ host: NAME, ports: [443] }],
      credentials: [{ host: NAME, header: "x-api-key", fromEnv: "ABOX_SERVE_TEST_KEY" }],
      resolve: { [NAME]: "127.0.0.1" }
    })
    const broker = yield* makeHttpsBroker(options)
    const sessionScope = yield* Scope.make()
    const session = yield* broker
      .make(policy, { sessionId: "s-serve", sessionDir })
      .pipe(Scope.extend(sessionScope))
    const queue = yield* Queue.unbounded<TunnelRequest>()
    yield* session.serve(Stream.fromQueue(queue)).pipe(Effect.forkIn(sessionScope))
    const open = Effect.fn(function* (channel: number) {
      const tunnel = inMemoryTunnel(channel, NAME, 443)
      yield* Queue.offer(queue, tunnel.request)
      const opened = yield* Effect.promise(() => tunnel.result)
      if (!opened.ok) return yield* Effect.dieMessage(`tunnel denied: ${opened.reason}`)
      const ended = new Promise<void>((resolve) => opened.stream.once("close", () => resolve()))
      opened.stream.resume()
      return { stream: opened.stream, ended: Effect.promise(() => ended) }
    })
    return { session, sessionScope, open }
  })

const bounded = <A, E, R>(what: string, effect: Effect.Effect<A, E, R>) =>
  effect.pipe(Effect.timeoutFail({ duration: "5 seconds", onTimeout: () => new Error(`${what} hangs`) }))

describe("HttpsBroker serving a tunnel (an interruptible, scoped Effect)", () => {
  it.live(
    "a termination that cannot be set up is a typed failure: logged as an error, named in the close line",
    () => {
      const logged: Array<{ level: string; text: string }> = []
      const capture = Logger.make(({ cause, logLevel, message }) => {
        logged.push({ level: logLevel.label, text: `${JSON.stringify(message)} ${Cause.pretty(cause)}` })
      })
      return Effect.gen(function* () {
        // a negative header bound: node refuses to make the TLS server for the tunnel
        const env = yield* brokerSession({ maxHeaderBytes: -1 })
        const tunnel = yield* env.open(1)
        yield* bounded("the failed tunnel's close", tunnel.ended)
        // the tunnel's fiber is done (its slot given back) before the session closes
        yield* bounded(
          "the tunnel's slot",
          env.session.active.pipe(
            Effect.repeat({ until: (n) => n === 0, schedule: Schedule.spaced("10 millis") })
          )
        )
        yield* Scope.close(env.sessionScope, Exit.void)
        const log = (yield* readBrokerLog(env.session.logPath)).entries
        expect(log.map((e) => [e.event, e.decision, e.reason])).toEqual([
          ["open", "allow", undefined],
          ["close", "allow", "broker-failed:terminate"]
        ])
        const errors = logged.filter((l) => l.level === LogLevel.Error.label)
        expect(errors.length).toBe(1)
        expect(errors[0]!.text).toContain("broker tunnel failed")
        expect(errors[0]!.text).toContain("TunnelFailed")
      }).pipe(
        Effect.scoped,
        Effect.provide(NodeFileSystem.layer),
        Effect.provide(Logger.replace(Logger.defaultLogger, capture))
      )
    }
  )

  it.live(
    "closing the session's scope interrupts a terminated tunnel: the guest end closes, the close line says so",
    () =>
      Effect.gen(function* () {
        const env = yield* brokerSession({})
        const tunnel = yield* env.open(2)
        // the TLS handshake is under way (a ClientHello sent, never finished)
        tunnel.stream.write(yield* Effect.promise(() => clientHelloBytes(NAME)))
        yield* bounded("closing the session scope", Scope.close(env.sessionScope, Exit.void))
        yield* bounded("the guest end's close", tunnel.ended)
        const log = (yield* readBrokerLog(env.session.logPath)).entries
        expect(log.map((e) => [e.event, e.decision, e.reason])).toEqual([
          ["open", "allow", undefined],
          ["close", "allow", "session-closed"]
        ])
      }).pipe(Effect.scoped, Effect.provide(NodeFileSystem.layer))
  )
})
