import { beforeAll, describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Scope from "effect/Scope"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { exitCodeFor } from "../src/cli/exitCodes.js"
import { RuntimeLockLive } from "../src/layers/RuntimeLockLive.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { RuntimeLock } from "../src/services/RuntimeLock.js"
import { bundleScript, killAll, startScript, type Worker } from "./support/scriptWorker.js"

let WORKER = ""
const BUSY_EXIT = exitCodeFor("SessionBusy")

/** a fresh home with one session directory */
const makeHome = Effect.acquireRelease(
  Effect.sync(() => {
    const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-lock-"))
    fs.mkdirSync(path.join(home, "sessions", "s1"), { recursive: true, mode: 0o700 })
    return home
  }),
  (home) => Effect.sync(() => fs.rmSync(home, { recursive: true, force: true }))
)

const lockLayer = (home: string) => RuntimeLockLive.pipe(Layer.provide(aboxPathsAt(home)))

const worker = (workers: Array<Worker>, home: string, mode: string, id = "s1") => {
  const started = startScript(WORKER, [home, id, mode])
  workers.push(started)
  return started
}

/** `ACQUIRED 1.2` / `SessionBusy 0.8` → [word, ms] */
const parse = (line: string): readonly [string, number] => {
  const [word, ms] = line.split(" ")
  return [word ?? "", Number(ms)]
}

describe("RuntimeLock in one process", () => {
  it.scoped("a second acquire of a held session fails SessionBusy at once, and works after release", () =>
    Effect.gen(function* () {
      const home = yield* makeHome
      const lock = yield* RuntimeLock.pipe(Effect.provide(lockLayer(home)))

      const first = yield* Scope.make()
      const held = yield* lock.acquire("s1").pipe(Scope.extend(first))
      expect(held.sessionId).toBe("s1")
      expect(held.path).toBe(path.join(home, "sessions", "s1", "lock"))

      const second = yield* Effect.scoped(lock.acquire("s1")).pipe(Effect.exit)
      expect(Exit.isFailure(second)).toBe(true)
      const error = yield* Effect.flip(Effect.scoped(lock.acquire("s1")))
      expect(error._tag).toBe("SessionBusy")
      expect(error._tag === "SessionBusy" && error.sessionId).toBe("s1")

      // another session is independent
      fs.mkdirSync(path.join(home, "sessions", "s2"))
      yield* Effect.scoped(lock.acquire("s2"))

      yield* Scope.close(first, Exit.void)
      const again = yield* Effect.scoped(lock.acquire("s1").pipe(Effect.map((h) => h.sessionId)))
      expect(again).toBe("s1")

      // the lock file stays, 0600
      const stat = fs.statSync(held.path)
      expect(stat.mode & 0o777).toBe(0o600)
    })
  )

  it.scoped("a session without a directory is a LockError; a path-like id is refused", () =>
    Effect.gen(function* () {
      const home = yield* makeHome
      const lock = yield* RuntimeLock.pipe(Effect.provide(lockLayer(home)))
      const missing = yield* Effect.flip(Effect.scoped(lock.acquire("nope")))
      expect(missing._tag).toBe("LockError")
      expect(fs.existsSync(path.join(home, "sessions", "nope"))).toBe(false)
      const traversal = yield* Effect.flip(Effect.scoped(lock.acquire("../s1")))
      expect(traversal._tag).toBe("LockError")
    })
  )

  it.scoped("fibers racing for one session: exactly one wins", () =>
    Effect.gen(function* () {
      const home = yield* makeHome
      const lock = yield* RuntimeLock.pipe(Effect.provide(lockLayer(home)))
      const scopes = yield* Effect.forEach(Array.from({ length: 10 }), () => Scope.make())
      const results = yield* Effect.forEach(
        scopes,
        (scope) => lock.acquire("s1").pipe(Scope.extend(scope), Effect.either),
        { concurrency: "unbounded" }
      )
      expect(results.filter((r) => r._tag === "Right")).toHaveLength(1)
      for (const r of results) if (r._tag === "Left") expect(r.left._tag).toBe("SessionBusy")
      yield* Effect.forEach(scopes, (scope) => Scope.close(scope, Exit.void))
    })
  )
})

describe("RuntimeLock across real processes", () => {
  beforeAll(async () => {
    WORKER = await Effect.runPromise(bundleScript("test/support/lockWorker.ts"))
  }, 60_000)

  it.scopedLive(
    "20 processes race: one wins, every loser fails SessionBusy while the winner holds it; SIGKILL of the winner frees it at once",
    () =>
      Effect.gen(function* () {
        const home = yield* makeHome
        const workers: Array<Worker> = []
        yield* Effect.addFinalizer(() => killAll(workers))
        const racers = Array.from({ length: 20 }, () => worker(workers, home, "race"))
        // every racer is up and waiting; then they all go at once
        yield* Effect.forEach(racers, (racer) => racer.line, { concurrency: "unbounded" }).pipe(
          Effect.map((lines) => expect(lines.every((line) => line === "READY")).toBe(true))
        )
        for (const racer of racers) racer.child.stdin!.write("go\n")
        const outcomes = yield* Effect.forEach(racers, (racer) => racer.line.pipe(Effect.map(parse)), {
          concurrency: "unbounded"
        })
        const winners = racers.filter((_, i) => outcomes[i]![0] === "ACQUIRED")
        const losers = racers.filter((_, i) => outcomes[i]![0] !== "ACQUIRED")
        expect(winners).toHaveLength(1)
        expect(losers).toHaveLength(19)
        // every loser answered while the winner was alive and holding the lock (it holds it until
        // it is killed below): a loser that waited for the winner would not have answered by now.
        // No wall-clock bound: under load the acquire's time says nothing about waiting.
        const winner = winners[0]!
        expect(winner.child.exitCode).toBe(null)
        expect(winner.child.signalCode).toBe(null)
        for (const [word] of outcomes) {
          if (word === "ACQUIRED") continue
          expect(word).toBe("SessionBusy")
        }
        const codes = yield* Effect.forEach(losers, (loser) => loser.exited)
        expect(codes.every((c) => c.code === BUSY_EXIT)).toBe(true)
        const slowest = Math.max(...outcomes.filter(([w]) => w !== "ACQUIRED").map(([, ms]) => ms))
        console.log(`lock race: 19 losers failed SessionBusy, slowest acquire ${slowest.toFixed(1)} ms`)

        // the winner still holds it
        const probe = worker(workers, home, "try")
        expect(parse(yield* probe.line)[0]).toBe("SessionBusy")
        expect(winner.child.exitCode).toBe(null)

        // SIGKILL the winner: the kernel drops the lock with the process, no stale window. The
        // acquire does not wait (tryLock): the first try after the winner's exit gets it, or it
        // would say SessionBusy
        winner.child.kill("SIGKILL")
        const died = yield* winner.exited
        expect(died.signal).toBe("SIGKILL")
        const next = worker(workers, home, "try")
        expect(parse(yield* next.line)[0]).toBe("ACQUIRED")
        expect((yield* next.exited).code).toBe(0)
      }),
    60_000
  )

  it.scopedLive(
    "a child that inherited the handed-off fd keeps the lock after its parent exits; it is free when the child dies",
    () =>
      Effect.gen(function* () {
        const home = yield* makeHome
        const workers: Array<Worker> = []
        yield* Effect.addFinalizer(() => killAll(workers))
        const parent = worker(workers, home, "handoff")
        expect(parse(yield* parent.line)[0]).toBe("ACQUIRED")
        const [tag, pidText] = parse(yield* parent.line)
        expect(tag).toBe("CHILD")
        const childPid = pidText
        yield* Effect.addFinalizer(() => Effect.sync(() => killQuietly(childPid)))
        expect((yield* parent.exited).code).toBe(0)

        const probe = worker(workers, home, "try")
        expect(parse(yield* probe.line)[0]).toBe("SessionBusy")
        expect((yield* probe.exited).code).toBe(BUSY_EXIT)

        process.kill(childPid, "SIGKILL")
        // the child inherited the parent's stdout: it closes when the child is gone
        yield* parent.closed
        const after = worker(workers, home, "try")
        expect(parse(yield* after.line)[0]).toBe("ACQUIRED")
      }),
    60_000
  )

  it.scopedLive(
    "without handOff, the parent's release unlocks the shared description even for a live child",
    () =>
      Effect.gen(function* () {
        const home = yield* makeHome
        const workers: Array<Worker> = []
        yield* Effect.addFinalizer(() => killAll(workers))
        const parent = worker(workers, home, "nohandoff")
        expect(parse(yield* parent.line)[0]).toBe("ACQUIRED")
        const [, childPid] = parse(yield* parent.line)
        yield* Effect.addFinalizer(() => Effect.sync(() => killQuietly(childPid)))
        yield* parent.exited
        expect(isAlive(childPid)).toBe(true)
        const probe = worker(workers, home, "try")
        expect(parse(yield* probe.line)[0]).toBe("ACQUIRED")
      }),
    60_000
  )
})

const isAlive = (pid: number): boolean => {
  try {
    process.kill(pid, 0)
    return true
  } catch {
    return false
  }
}

const killQuietly = (pid: number) => {
  try {
    process.kill(pid, "SIGKILL")
  } catch {
    // already gone
  }
}
