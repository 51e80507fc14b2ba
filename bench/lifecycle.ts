/**
 * Lifecycle figures on a real VM (need qemu-system-x86_64 and the test image):
 * - lifecycleRun: `abox run <small repo> -- true` (the built CLI, whole process) vs a bare QEMU
 *   boot of the same image to init's first serial line; per-phase medians in the note
 * - lifecycleTurn: a no-op turn while a session is open (VM) vs the same turn over the fake
 *   backend (the guest agent as a host process): what TCG and virtio-serial add to a turn
 * - transferTree50MB: Open's repo transfer vs `tar | tar` (fake backend)
 * - lifecycleRss: CLI + helper memory during a turn vs a 120 MiB budget
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Stream from "effect/Stream"
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import * as FakeVmm from "../src/layers/FakeVmm.js"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { HttpsBrokerLive } from "../src/broker/HttpsBrokerLive.js"
import { FakeImages } from "../src/layers/Lifecycle.js"
import { QemuVmmLive } from "../src/layers/QemuVmm.js"
import { RuntimeLockLive } from "../src/layers/RuntimeLockLive.js"
import { SessionStoreLive } from "../src/layers/SessionStoreLive.js"
import { ImagesLive } from "../src/layers/ImagesLive.js"
import { open, type Phase } from "../src/programs/session.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { testHome } from "../test/e2e-vm-image.js"
import { type BenchContext, type Figure, cli, median, round, timeOnce } from "./lib.js"
import { accelInUse, bareBoot, freshDir, image } from "./vmm.js"

/** an ABOX_HOME of its own whose images are the shared test image's */
export const benchHome = (ctx: BenchContext, name: string) => {
  const home = fs.mkdtempSync(path.join(ctx.tmp, `${name}-`))
  fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
  return home
}

const smallRepo = (ctx: BenchContext) => {
  const repo = fs.mkdtempSync(path.join(ctx.tmp, "repo-"))
  fs.writeFileSync(path.join(repo, "README.md"), "bench\n")
  fs.mkdirSync(path.join(repo, "src"))
  for (let i = 0; i < 50; i++) fs.writeFileSync(path.join(repo, "src", `f${i}.txt`), "x".repeat(1000))
  return repo
}

export const layerFor = (home: string, fake: boolean) =>
  Layer.mergeAll(
    SessionStoreLive,
    RuntimeLockLive,
    GuestRpcLive,
    HttpsBrokerLive,
    fake
      ? Layer.merge(FakeVmm.layer, FakeImages)
      : Layer.merge(QemuVmmLive({ note: () => undefined }), ImagesLive)
  ).pipe(
    Layer.provideMerge(aboxPathsAt(home)),
    Layer.provideMerge(NodeCommandExecutor.layer),
    Layer.provideMerge(NodeFileSystem.layer)
  )

/** one open (phases timed), one `true` turn, close */
const phasedRun = (home: string, repo: string) =>
  Effect.runPromise(
    Effect.scoped(
      Effect.gen(function* () {
        const marks: Array<[Phase | "turn" | "close", number]> = []
        const t0 = performance.now()
        const onPhase = (phase: Phase) => Effect.sync(() => void marks.push([phase, performance.now() - t0]))
        const session = yield* open({ source: repo, onPhase })
        yield* Stream.runDrain(session.turn("true"))
        marks.push(["turn", performance.now() - t0])
        return marks
      })
    ).pipe(Effect.provide(layerFor(home, false)))
  )

export const lifecycleRun = async (ctx: BenchContext): Promise<Figure> => {
  const golden = await image()
  const runs = Math.min(ctx.runs, 3)
  const home = benchHome(ctx, "run")
  const repo = smallRepo(ctx)
  const dir = freshDir(ctx, "bare", golden)
  const accel = accelInUse()
  const run = (warm = true) =>
    timeOnce([process.execPath, cli, "run", repo, "--", "true"], {
      ABOX_HOME: home,
      ...(warm ? {} : { ABOX_WARM: "0" })
    })
  // the first run makes the image's warm snapshot (docs/on-disk.md "Warm snapshots")
  run()
  const totals: Array<number> = []
  const colds: Array<number> = []
  const floors: Array<number> = []
  for (let i = 0; i < runs; i++) {
    totals.push(run())
    colds.push(run(false))
    floors.push(await bareBoot(golden, dir, accel))
  }
  // per phase, in process (the CLI prints its step display only on a terminal)
  const phases: Record<string, Array<number>> = {}
  for (let i = 0; i < runs; i++) {
    const marks = await phasedRun(home, repo)
    // a phase lasts from its own mark to the next one's ("turn" marks the end of the turn)
    marks.slice(1).forEach(([, at], k) => {
      const [phase, began] = marks[k]!
      ;(phases[phase] ??= []).push(at - began)
    })
  }
  const perPhase = Object.entries(phases)
    .map(([phase, ms]) => `${phase} ${Math.round(median(ms))}`)
    .join(", ")
  const medianMs = median(totals)
  const floorMs = median(floors)
  return {
    ratio: round(medianMs / floorMs),
    medianMs: round(medianMs),
    floorMs: round(floorMs),
    runs,
    goal: 0.5,
    note: `abox run -- true, whole CLI process (open from the image's warm snapshot, turn, close) vs bare qemu to 'abox-init: started' (${accel}); a cold open (ABOX_WARM=0) ${round(median(colds) / floorMs)}x; phases in ms (boot = VMM start to the guest's hello; ready = the turn): ${perPhase}`
  }
}

const turnLatency = (home: string, repo: string, fake: boolean, turns: number) =>
  Effect.runPromise(
    Effect.scoped(
      Effect.gen(function* () {
        const session = yield* open({ source: repo })
        yield* Stream.runDrain(session.turn("true"))
        const times: Array<number> = []
        for (let i = 0; i < turns; i++) {
          const t0 = performance.now()
          yield* Stream.runDrain(session.turn("true"))
          times.push(performance.now() - t0)
        }
        return median(times)
      })
    ).pipe(Effect.provide(layerFor(home, fake)))
  )

export const lifecycleTurn = async (ctx: BenchContext): Promise<Figure> => {
  await image()
  const turns = Math.max(5, ctx.runs)
  const repo = smallRepo(ctx)
  const vm = await turnLatency(benchHome(ctx, "turn-vm"), repo, false, turns)
  const host = await turnLatency(benchHome(ctx, "turn-fake"), repo, true, turns)
  return {
    ratio: round(vm / host),
    medianMs: round(vm),
    floorMs: round(host),
    runs: turns,
    note: "a `true` turn (user_turn → turn_end) in an open VM session vs the same turn over the fake backend (guest agent on the host)"
  }
}

/** a tree of `bytes` in files of 256 KiB (incompressible content, like a repository's objects) */
const treeOf = (ctx: BenchContext, bytes: number) => {
  const root = fs.mkdtempSync(path.join(ctx.tmp, "tree-"))
  const file = Buffer.alloc(256 * 1024)
  for (let i = 0; i * file.length < bytes; i++) {
    const dir = path.join(root, `d${i % 16}`)
    fs.mkdirSync(dir, { recursive: true })
    for (let k = 0; k < file.length; k += 4) file.writeUInt32LE((i * 2654435761 + k * 40503) >>> 0, k)
    fs.writeFileSync(path.join(dir, `f${i}.bin`), file)
  }
  return root
}

/**
 * transferTree50MB: Open's transfer phase (snapshot as tar → protocol v4 channel with flow
 * control → the guest agent extracts into its repo; fake backend, so TCG does not dominate) vs
 * the floor `tar -c | tar -x` of the same tree; ratio = throughput (goal ≥ 0.7)
 */
export const transferTree50MB = async (ctx: BenchContext): Promise<Figure> => {
  const bytes = 50 * 1024 * 1024
  const tree = treeOf(ctx, bytes)
  const runs = Math.min(ctx.runs, 5)
  const transferMs = () =>
    Effect.runPromise(
      Effect.scoped(
        Effect.gen(function* () {
          let started = 0
          let ended = 0
          const onPhase = (phase: Phase) =>
            Effect.sync(() => {
              if (phase === "transfer") started = performance.now()
              if (phase === "ready") ended = performance.now()
            })
          yield* open({ source: tree, onPhase })
          return ended - started
        })
      ).pipe(Effect.provide(layerFor(benchHome(ctx, "transfer"), true)))
    )
  const tarMs = () => {
    const target = fs.mkdtempSync(path.join(ctx.tmp, "untar-"))
    const ms = timeOnce(["sh", "-c", `tar -C '${tree}' -cf - . | tar -C '${target}' -xf -`])
    fs.rmSync(target, { recursive: true, force: true })
    return ms
  }
  await transferMs()
  tarMs()
  const ours: Array<number> = []
  const floor: Array<number> = []
  for (let i = 0; i < runs; i++) {
    ours.push(await transferMs())
    floor.push(tarMs())
  }
  const medianMs = median(ours)
  const floorMs = median(floor)
  const mibs = (ms: number) => round(bytes / 1048576 / (ms / 1000), 0)
  return {
    ratio: round(floorMs / medianMs),
    medianMs: round(medianMs),
    floorMs: round(floorMs),
    runs,
    goal: 0.7,
    note: `ratio = throughput vs tar | tar; abox ${mibs(medianMs)} MiB/s, floor ${mibs(floorMs)} MiB/s`
  }
}

export const rssKiB = (pid: number): number =>
  Number(/VmRSS:\s+(\d+)/.exec(fs.readFileSync(`/proc/${pid}/status`, "utf8"))?.[1] ?? 0)

/** the `abox-vmm` helper that process `pid` started, if one runs */
export const helperOf = (pid: number): number | undefined => {
  const helper = fs
    .readdirSync("/proc")
    .filter((p) => /^\d+$/.test(p))
    .find((p) => {
      try {
        return (
          fs.readFileSync(`/proc/${p}/cmdline`, "utf8").includes("abox-vmm") &&
          /PPid:\s+(\d+)/.exec(fs.readFileSync(`/proc/${p}/status`, "utf8"))?.[1] === String(pid)
        )
      } catch {
        return false
      }
    })
  return helper === undefined ? undefined : Number(helper)
}

/**
 * lifecycleRss: the host's memory while a session runs a turn — the `abox` CLI process plus its
 * `abox-vmm` helper (QEMU itself, the guest's RAM, is not counted), in MiB, against 120 MiB
 */
export const lifecycleRss = async (ctx: BenchContext): Promise<Figure> => {
  await image()
  const home = benchHome(ctx, "rss")
  const repo = smallRepo(ctx)
  const samples: Array<number> = []
  for (let i = 0; i < Math.min(ctx.runs, 3); i++) {
    const child = spawn(process.execPath, [cli, "run", repo, "--", "echo measuring; sleep 2"], {
      env: { ...process.env, ABOX_HOME: home },
      stdio: ["ignore", "pipe", "ignore"]
    })
    await new Promise<void>((resolve) =>
      child.stdout.on("data", (d: Buffer) => d.toString().includes("measuring") && resolve())
    )
    const helper = helperOf(child.pid!)
    samples.push((rssKiB(child.pid!) + (helper === undefined ? 0 : rssKiB(helper))) / 1024)
    await new Promise((resolve) => child.on("exit", resolve))
  }
  const mib = median(samples)
  return {
    ratio: round(mib / 120),
    medianMs: round(mib, 1),
    floorMs: 120,
    runs: samples.length,
    goal: 1,
    note: "MiB (not ms): abox CLI + abox-vmm helper RSS during a turn, against a 120 MiB budget"
  }
}
