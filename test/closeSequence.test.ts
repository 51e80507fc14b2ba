/**
 * The close sequence (src/lib/closeSequence.ts), once, under the TestClock: a scripted VM whose
 * exit is a Deferred, answering (or not) the shutdown request, the signal and SIGKILL. The bounds
 * are the production defaults' shape but pass only when the clock is moved.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as TestClock from "effect/TestClock"
import { type CloseSequenceBounds, closeSequence, type ProcessExit } from "../src/lib/closeSequence.js"

const bounds: CloseSequenceBounds = { graceful: "15 seconds", signalled: "5 seconds", killed: "5 seconds" }

type Step = "shutdown" | "signal" | "kill"

/** what the scripted VM does when asked: exit with a status, or nothing */
interface Script {
  readonly onShutdown?: ProcessExit
  readonly onSignal?: ProcessExit
  readonly onKill?: ProcessExit
}

const clean: ProcessExit = { exitCode: 0, signal: null }

const scripted = (script: Script) =>
  Effect.gen(function* () {
    const exit = yield* Deferred.make<ProcessExit>()
    const sent: Array<Step> = []
    const step = (name: Step, then: ProcessExit | undefined) =>
      Effect.suspend(() => {
        sent.push(name)
        return then === undefined ? Effect.void : Deferred.succeed(exit, then)
      })
    const run = closeSequence({
      bounds,
      poll: Deferred.poll(exit).pipe(
        Effect.flatMap((done) => (Option.isSome(done) ? Effect.asSome(done.value) : Effect.succeedNone))
      ),
      exited: Deferred.await(exit),
      shutdown: step("shutdown", script.onShutdown),
      signal: step("signal", script.onSignal),
      kill: step("kill", script.onKill)
    }).pipe(
      // as in a scope's finalizer: the bounds must cut the waits all the same
      Effect.uninterruptible
    )
    return { exit, sent, run }
  })

describe("the close sequence (TestClock)", () => {
  it.effect("exits on the shutdown request within the graceful bound: graceful, nothing signalled", () =>
    Effect.gen(function* () {
      const vm = yield* scripted({ onShutdown: clean })
      const result = yield* vm.run
      expect(result).toEqual({ how: "graceful", exit: Option.some(clean) })
      expect(vm.sent).toEqual(["shutdown"])
    })
  )

  it.effect("exits on the shutdown request late but within the bound: graceful", () =>
    Effect.gen(function* () {
      const vm = yield* scripted({})
      const closing = yield* Effect.fork(vm.run)
      // adjust first waits for the closing fiber to suspend (on its bound), then moves the clock
      yield* TestClock.adjust("14 seconds")
      yield* Deferred.succeed(vm.exit, clean)
      expect(yield* Fiber.join(closing)).toEqual({ how: "graceful", exit: Option.some(clean) })
      expect(vm.sent).toEqual(["shutdown"])
    })
  )

  it.effect("fails after the shutdown request (a status that is not clean): crashed", () =>
    Effect.gen(function* () {
      const failed = { exitCode: 1, signal: null }
      const vm = yield* scripted({ onShutdown: failed })
      expect(yield* vm.run).toEqual({ how: "crashed", exit: Option.some(failed) })
      expect(vm.sent).toEqual(["shutdown"])
    })
  )

  it.effect("gone before the shutdown is even asked: nothing is sent; clean → graceful, else crashed", () =>
    Effect.gen(function* () {
      const poweredOff = yield* scripted({})
      yield* Deferred.succeed(poweredOff.exit, clean)
      expect(yield* poweredOff.run).toEqual({ how: "graceful", exit: Option.some(clean) })
      expect(poweredOff.sent).toEqual([])

      const died = { exitCode: null, signal: "SIGSEGV" }
      const crashed = yield* scripted({})
      yield* Deferred.succeed(crashed.exit, died)
      expect(yield* crashed.run).toEqual({ how: "crashed", exit: Option.some(died) })
      expect(crashed.sent).toEqual([])
    })
  )

  it.effect("ignores the shutdown, exits on the signal: signalled, once the graceful bound has passed", () =>
    Effect.gen(function* () {
      const byTerm = { exitCode: null, signal: "SIGTERM" }
      const vm = yield* scripted({ onSignal: byTerm })
      const closing = yield* Effect.fork(vm.run)
      yield* TestClock.adjust("14999 millis")
      expect(vm.sent).toEqual(["shutdown"])
      yield* TestClock.adjust("1 milli")
      expect(yield* Fiber.join(closing)).toEqual({ how: "signalled", exit: Option.some(byTerm) })
      expect(vm.sent).toEqual(["shutdown", "signal"])
    })
  )

  it.effect("ignores the shutdown and the signal: SIGKILL after the second bound, then reaped: killed", () =>
    Effect.gen(function* () {
      const byKill = { exitCode: null, signal: "SIGKILL" }
      const vm = yield* scripted({ onKill: byKill })
      const closing = yield* Effect.fork(vm.run)
      yield* TestClock.adjust("15 seconds")
      expect(vm.sent).toEqual(["shutdown", "signal"])
      yield* TestClock.adjust("4999 millis")
      expect(vm.sent).toEqual(["shutdown", "signal"])
      yield* TestClock.adjust("1 milli")
      expect(yield* Fiber.join(closing)).toEqual({ how: "killed", exit: Option.some(byKill) })
      expect(vm.sent).toEqual(["shutdown", "signal", "kill"])
    })
  )

  it.effect("never reaped: killed with no exit, after the last bound (Close does not hang)", () =>
    Effect.gen(function* () {
      const vm = yield* scripted({})
      const closing = yield* Effect.fork(vm.run)
      for (const bound of ["15 seconds", "5 seconds", "4999 millis"] as const) {
        yield* TestClock.adjust(bound)
      }
      expect(Option.isNone(yield* Fiber.poll(closing))).toBe(true)
      yield* TestClock.adjust("1 milli")
      expect(yield* Fiber.join(closing)).toEqual({ how: "killed", exit: Option.none() })
      expect(vm.sent).toEqual(["shutdown", "signal", "kill"])
    })
  )

  it.effect("a shutdown request that hangs is cut by the graceful bound", () =>
    Effect.gen(function* () {
      const exit = yield* Deferred.make<ProcessExit>()
      const closing = yield* Effect.fork(
        closeSequence({
          bounds,
          poll: Effect.succeedNone,
          exited: Deferred.await(exit),
          shutdown: Effect.never,
          signal: Deferred.succeed(exit, { exitCode: 0, signal: null }),
          kill: Effect.void
        }).pipe(Effect.uninterruptible)
      )
      yield* TestClock.adjust("15 seconds")
      expect(yield* Fiber.join(closing)).toEqual({ how: "signalled", exit: Option.some(clean) })
    })
  )
})
