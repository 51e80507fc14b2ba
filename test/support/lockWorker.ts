/**
 * A real process taking a session's runtime lock through RuntimeLockLive, for the multi-process
 * tests in test/lock.test.ts. Prints one line per event on stdout:
 *
 *   node --import tsx test/support/lockWorker.ts <home> <sessionId> <mode>
 *
 * modes:
 *   try      acquire now; `ACQUIRED <ms>` (then release, exit 0) or `<Tag> <ms>` (exit code of the tag)
 *   race     print `READY`, wait for one line on stdin, then acquire; the winner prints
 *            `ACQUIRED <ms>` and holds the lock until stdin closes or it is killed
 *   handoff  acquire, spawn a child that inherits the fd, `handOff`, print `CHILD <pid>`, close
 *            the scope and exit: the child holds the lock until it dies
 *   nohandoff  like handoff without `handOff`: the scope's unlock frees the lock for the child too
 */
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import { spawn } from "node:child_process"
import { createInterface } from "node:readline"
import { exitCodeFor } from "../../src/cli/exitCodes.js"
import { RuntimeLockLive } from "../../src/layers/RuntimeLockLive.js"
import { aboxPathsAt } from "../../src/services/AboxPaths.js"
import { RuntimeLock } from "../../src/services/RuntimeLock.js"

const [home, sessionId, mode] = process.argv.slice(2)
if (home === undefined || sessionId === undefined || mode === undefined) {
  process.stderr.write("usage: lockWorker <home> <sessionId> <try|race|handoff|nohandoff>\n")
  process.exit(64)
}

const say = (line: string) => Effect.sync(() => process.stdout.write(`${line}\n`))

const firstLine = Effect.async<void>((resume) => {
  const lines = createInterface({ input: process.stdin })
  lines.once("line", () => {
    lines.close()
    resume(Effect.void)
  })
})

const stdinClosed = Effect.async<void>((resume) => {
  process.stdin.resume()
  process.stdin.once("end", () => resume(Effect.void))
  process.stdin.once("close", () => resume(Effect.void))
})

const timedAcquire = Effect.gen(function* () {
  const lock = yield* RuntimeLock
  const started = performance.now()
  const held = yield* lock
    .acquire(sessionId)
    .pipe(Effect.tapError((error) => say(`${error._tag} ${(performance.now() - started).toFixed(1)}`)))
  yield* say(`ACQUIRED ${(performance.now() - started).toFixed(1)}`)
  return held
})

// a child that only holds fd 3 (the inherited lock) and exits on its own after a minute at most
const HOLDER = "setTimeout(() => {}, 60000)"

const withChild = (handOff: boolean) =>
  Effect.scoped(
    Effect.gen(function* () {
      const held = yield* timedAcquire
      const child = spawn(process.execPath, ["-e", HOLDER], {
        // stdout inherited: the test sees it close when the child is gone
        stdio: ["ignore", "inherit", "ignore", held.fd],
        detached: true
      })
      child.unref()
      if (handOff) yield* held.handOff
      yield* say(`CHILD ${child.pid}`)
    })
  )

const program = Effect.gen(function* () {
  switch (mode) {
    case "try":
      return yield* Effect.scoped(timedAcquire)
    case "race":
      yield* say("READY")
      yield* firstLine
      return yield* Effect.scoped(timedAcquire.pipe(Effect.zipRight(stdinClosed)))
    case "handoff":
      return yield* withChild(true)
    case "nohandoff":
      return yield* withChild(false)
    default:
      return yield* Effect.die(`unknown mode ${mode}`)
  }
})

const exit = await Effect.runPromiseExit(
  program.pipe(Effect.provide(RuntimeLockLive), Effect.provide(aboxPathsAt(home)))
)
if (Exit.isFailure(exit)) {
  const failure = exit.cause._tag === "Fail" ? exit.cause.error : undefined
  process.exitCode = failure !== undefined ? exitCodeFor(failure._tag) : 99
  if (failure === undefined) process.stderr.write(`${String(exit.cause)}\n`)
}
process.exit()
