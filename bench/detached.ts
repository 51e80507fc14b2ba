/**
 * detachedExec (needs qemu-system-x86_64 and the test image): `abox exec <ref> -- true` — the
 * built CLI, a whole process, against a session a supervisor holds — vs the same `true` turn
 * inside the process that holds the session (goal: ≤ 1.5×). The note adds the same turn over
 * the control socket from inside a process (no process start) and the CLI's bare start-up.
 */
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import { remoteTurn, stop } from "../src/programs/detached.js"
import { open, type Session } from "../src/programs/session.js"
import { supervise } from "../src/programs/supervisor.js"
import { testHome } from "../test/e2e-vm-image.js"
import { type BenchContext, type Figure, cli, median, round, timeOnce } from "./lib.js"
import { layerFor } from "./lifecycle.js"
import { image } from "./vmm.js"

export const detachedExec = async (ctx: BenchContext): Promise<Figure> => {
  await image()
  const home = fs.mkdtempSync(path.join(ctx.tmp, "detached-"))
  fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
  const repo = fs.mkdtempSync(path.join(ctx.tmp, "repo-"))
  fs.writeFileSync(path.join(repo, "README.md"), "bench\n")
  const runs = Math.max(5, ctx.runs)
  const timed = <A, E, R>(effect: Effect.Effect<A, E, R>) =>
    Effect.gen(function* () {
      const t0 = performance.now()
      yield* effect
      return performance.now() - t0
    })
  return Effect.runPromise(
    Effect.gen(function* () {
      const held = yield* Deferred.make<Session>()
      const ready = yield* Deferred.make<void>()
      const supervisor = yield* supervise(
        Effect.tap(open({ source: repo, name: "bench" }), (session) => Deferred.succeed(held, session)),
        { onReady: () => Deferred.succeed(ready, undefined) }
      ).pipe(Effect.fork)
      yield* Deferred.await(ready)
      const session = yield* Deferred.await(held)
      const inProcess = timed(Stream.runDrain(session.turn("true")))
      const overSocket = timed(Stream.runDrain(remoteTurn("bench", "true")))
      const exec = Effect.sync(() =>
        timeOnce([process.execPath, cli, "exec", "bench", "--", "true"], { ABOX_HOME: home })
      )
      const cliStart = Effect.sync(() => timeOnce([process.execPath, cli, "--version"], { ABOX_HOME: home }))
      // warm-up, then alternate so that drift hits every kind alike
      yield* Effect.all([inProcess, overSocket, exec, cliStart])
      const samples = {
        inProcess: [] as Array<number>,
        overSocket: [] as Array<number>,
        exec: [] as Array<number>,
        cliStart: [] as Array<number>
      }
      for (let i = 0; i < runs; i++) {
        samples.inProcess.push(yield* inProcess)
        samples.exec.push(yield* exec)
        samples.overSocket.push(yield* overSocket)
        samples.cliStart.push(yield* cliStart)
      }
      yield* stop("bench")
      yield* Fiber.join(supervisor)
      const floorMs = median(samples.inProcess)
      const medianMs = median(samples.exec)
      return {
        ratio: round(medianMs / floorMs),
        medianMs: round(medianMs),
        floorMs: round(floorMs),
        runs,
        goal: 1.5,
        note: `abox exec <ref> -- true (whole CLI process) vs a true turn in the process holding the session (QEMU); the same turn over the control socket in-process ${round(median(samples.overSocket))} ms; abox --version alone ${round(median(samples.cliStart))} ms`
      } satisfies Figure
    }).pipe(Effect.provide(layerFor(home, false)))
  )
}
