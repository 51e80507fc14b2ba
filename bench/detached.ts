/**
 * detachedExec (needs qemu-system-x86_64 and the test image): `abox exec <ref> -- true` — the
 * built CLI, a whole process, against a session a supervisor holds — vs the same `true` turn
 * inside the process that holds the session (goal: ≤ 1.5×). The note adds the same turn over
 * the control socket from inside a process (no process start) and the CLI's bare start-up.
 *
 * detachedRss: a detached session's supervisor (`abox start`) plus its `abox-vmm` helper, RSS
 * after a few turns over the control socket (QEMU, the guest's RAM, not counted): goal ≤ 80 MiB.
 */
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Stream from "effect/Stream"
import { spawn, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import { remoteTurn, stop } from "../src/programs/detached.js"
import { open, type Session } from "../src/programs/session.js"
import { supervise } from "../src/programs/supervisor.js"
import { testHome } from "../test/e2e-vm-image.js"
import { type BenchContext, type Figure, cli, median, round } from "./lib.js"
import { helperOf, layerFor, rssKiB } from "./lifecycle.js"
import { image } from "./vmm.js"

/** wall time of one process run (ms), without blocking this process's event loop */
const timeProcess = (argv: ReadonlyArray<string>, home: string) =>
  Effect.async<number, Error>((resume) => {
    const t0 = performance.now()
    const child = spawn(argv[0]!, argv.slice(1), {
      env: { ...process.env, ABOX_HOME: home },
      stdio: ["ignore", "ignore", "pipe"]
    })
    let stderr = ""
    child.stderr.on("data", (d: Buffer) => (stderr += d.toString()))
    child.once("exit", (code) =>
      resume(
        code === 0
          ? Effect.succeed(performance.now() - t0)
          : Effect.fail(new Error(`${argv.join(" ")} exited ${code}: ${stderr}`))
      )
    )
  })

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
      const overSocket = timed(Stream.runDrain(remoteTurn("bench", { text: "true" })))
      // asynchronous: this process serves the control socket the CLI connects to
      const exec = timeProcess([process.execPath, cli, "exec", "bench", "--", "true"], home)
      const cliStart = timeProcess([process.execPath, cli, "--version"], home)
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

export const detachedRss = async (ctx: BenchContext): Promise<Figure> => {
  await image()
  const home = fs.mkdtempSync(path.join(ctx.tmp, "detached-rss-"))
  fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
  const repo = fs.mkdtempSync(path.join(ctx.tmp, "repo-"))
  fs.writeFileSync(path.join(repo, "README.md"), "bench\n")
  const run = (args: ReadonlyArray<string>) => {
    const r = spawnSync(process.execPath, [cli, ...args], {
      env: { ...process.env, ABOX_HOME: home },
      encoding: "utf8",
      timeout: 300_000
    })
    if (r.status !== 0) throw new Error(`abox ${args.join(" ")} exited ${r.status}: ${r.stderr}`)
    return r.stdout
  }
  const { pid } = JSON.parse(run(["start", repo, "--name", "rss", "--json"])) as { pid: number }
  try {
    const samples: Array<number> = []
    for (let i = 0; i < Math.max(3, Math.min(ctx.runs, 5)); i++) {
      run(["exec", "rss", "--", "true"])
      const helper = helperOf(pid)
      samples.push((rssKiB(pid) + (helper === undefined ? 0 : rssKiB(helper))) / 1024)
    }
    const mib = median(samples)
    return {
      ratio: round(mib / 80),
      medianMs: round(mib, 1),
      floorMs: 80,
      runs: samples.length,
      goal: 1,
      note: "MiB (not ms): a detached session's supervisor + abox-vmm helper RSS after a turn over the control socket, against an 80 MiB budget"
    }
  } finally {
    run(["stop", "rss"])
  }
}
