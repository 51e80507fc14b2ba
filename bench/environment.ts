/**
 * Project environment figures (docs/environments.md), on the busybox test image as base:
 * - envBuild: an environment's first Open (setup VM: boot, a setup writing 32 MiB, shutdown,
 *   registration; then the session's Open) against an Open of the same repository without an
 *   environment; a cost paid once per environment (no goal; the figure is what it costs)
 * - envDisk: the environment image's overlay bytes (allocated) over what its setup wrote
 *   (32 MiB of random data); goal ≤ 1.05
 * - envOpen: an Open of the repository whose environment is built (and a `true` turn) against
 *   the same without an environment; goal ≤ 1.1
 */
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import { envList, openWithEnvironment } from "../src/programs/environment.js"
import { ensureTestImage } from "../test/e2e-vm-image.js"
import { type BenchContext, type Figure, median, round } from "./lib.js"
import { benchHome, layerFor } from "./lifecycle.js"

const MiB = 1024 * 1024
const WRITTEN_MIB = 32

const repoWith = (ctx: BenchContext, name: string, environment: boolean) => {
  const repo = fs.mkdtempSync(path.join(ctx.tmp, `${name}-`))
  fs.writeFileSync(path.join(repo, "README.md"), "bench\n")
  if (environment) {
    fs.mkdirSync(path.join(repo, ".abox"))
    fs.writeFileSync(path.join(repo, ".abox", "environment.json"), JSON.stringify({ base: "abox", env: { A: "1" } }))
    fs.writeFileSync(
      path.join(repo, ".abox", "setup.sh"),
      `set -e\nmkdir -p /opt/blob\ndd if=/dev/urandom of=/opt/blob/data bs=1M count=${WRITTEN_MIB} 2>/dev/null\nsync\n`
    )
  }
  return repo
}

/** one Open (with the repository's environment, if it has one) and a `true` turn, in ms */
const openOnce = (home: string, repo: string) =>
  Effect.runPromise(
    Effect.scoped(
      Effect.gen(function* () {
        const started = performance.now()
        const session = yield* openWithEnvironment({ source: repo, memoryMiB: 512 })
        yield* Stream.runDrain(session.turn("true"))
        return performance.now() - started
      })
    ).pipe(Effect.provide(layerFor(home, false)))
  )

let measured:
  | Promise<{
      readonly build: number
      readonly overlayBytes: number
      readonly plain: ReadonlyArray<number>
      readonly withEnv: ReadonlyArray<number>
      readonly runs: number
    }>
  | undefined

const measure = (ctx: BenchContext) =>
  (measured ??= (async () => {
    await ensureTestImage()
    const home = benchHome(ctx, "env-home")
    const plainRepo = repoWith(ctx, "env-plain", false)
    const envRepo = repoWith(ctx, "env-repo", true)
    await openOnce(home, plainRepo) // warm-up
    const build = await openOnce(home, envRepo)
    const images = await Effect.runPromise(envList().pipe(Effect.provide(layerFor(home, false))))
    const image = images.find((candidate) => candidate.meta.environment?.source === envRepo)
    if (image === undefined) throw new Error("the environment image was not registered")
    const overlayBytes = fs.statSync(path.join(image.dir, image.meta.files.root.file)).blocks * 512
    const runs = Math.min(ctx.runs, 5)
    const plain: Array<number> = []
    const withEnv: Array<number> = []
    try {
      for (let i = 0; i < runs; i++) {
        plain.push(await openOnce(home, plainRepo))
        withEnv.push(await openOnce(home, envRepo))
      }
    } finally {
      // the environment image lives in the shared test registry: removed with its directory
      fs.rmSync(image.dir, { recursive: true, force: true })
      try {
        fs.rmdirSync(path.dirname(image.dir))
      } catch {
        // another image of that name is left: it stays
      }
    }
    return { build, overlayBytes, plain, withEnv, runs }
  })())

export const envBuild = async (ctx: BenchContext): Promise<Figure> => {
  const m = await measure(ctx)
  return {
    ratio: round(m.build / median(m.plain), 2),
    medianMs: round(m.build, 0),
    floorMs: round(median(m.plain), 0),
    runs: 1,
    note: `the first Open of a repository whose setup writes ${WRITTEN_MIB} MiB (setup VM, then the session) vs an Open without an environment (test image)`
  }
}

export const envDisk = async (ctx: BenchContext): Promise<Figure> => {
  const m = await measure(ctx)
  return {
    ratio: round(m.overlayBytes / (WRITTEN_MIB * MiB), 3),
    medianMs: round(m.overlayBytes / MiB, 1),
    floorMs: WRITTEN_MIB,
    runs: 1,
    goal: 1.05,
    note: `MiB, not ms: the environment image's overlay (allocated) over the ${WRITTEN_MIB} MiB its setup wrote`
  }
}

export const envOpen = async (ctx: BenchContext): Promise<Figure> => {
  const m = await measure(ctx)
  return {
    ratio: round(median(m.withEnv) / median(m.plain), 3),
    medianMs: round(median(m.withEnv), 0),
    floorMs: round(median(m.plain), 0),
    runs: m.runs,
    goal: 1.1,
    note: "an Open (+ a `true` turn) of a repository with a built environment (an overlay over the environment's overlay) vs one without (test image)"
  }
}
