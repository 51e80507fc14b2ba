/**
 * Copy-on-write figures (docs/on-disk.md "The root disk"):
 * - vmmClone: Open's root disk (src/lib/rootDisk.ts `makeRootDisk`, what `abox open` runs) from
 *   the **workstation** golden, against a 20 ms budget; goal ≤ 1.0 whatever the golden's size
 * - cowMainJob5: the README's main job (`abox run examples/hello -- ./greet.sh`) run 5 times on
 *   the workstation image: how much `$ABOX_HOME` grew, over the golden's allocated bytes; goal ≤ 0.05
 * - cowSessionDisk: one session's own bytes right after the main job, over the golden's; goal ≤ 0.01
 * - cowSessions20: the disk of 20 such sessions and their image over that of one; goal ≤ 1.1
 *   (20 × the measured median of the 5 sessions above, plus the golden once)
 * - cowDiskThroughput: a turn writing then reading 256 MiB (`dd … conv=fsync` in /home/agent, the
 *   read with `iflag=direct`) on an overlay root against a raw copy (test image); goal ≤ 1.18
 *   (throughput ≥ 0.85×)
 * - cowIdleRss: QEMU's RSS (MiB) of an idle VM after its guest filled and freed 400 MiB (tmpfs),
 *   against 200 MiB (test image, -m 1024; the balloon's free page reporting gives it back); goal ≤ 1.0
 *
 * The workstation image: the one registered in the test home or in ~/.abox (read only: its
 * golden is a backing file, never written), else built (minutes).
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Scope from "effect/Scope"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import type { GoldenImage } from "../src/domain/image.js"
import { goldenOf, listImages } from "../src/lib/images.js"
import { diskUsageSync } from "../src/lib/diskUsage.js"
import { createOverlay, makeRootDisk } from "../src/lib/rootDisk.js"
import {
  bootSession,
  ensureWorkstationImage,
  runTurn,
  testHome,
  vmLayer,
  workstationSkipReason
} from "../test/e2e-vm-image.js"
import { type BenchContext, type Figure, cli, median, repo, round } from "./lib.js"
import { freshDir, image } from "./vmm.js"

const Exec = NodeCommandExecutor.layer.pipe(Layer.provide(NodeFileSystem.layer))
const allocated = (file: string) => fs.statSync(file).blocks * 512
const MiB = 1024 * 1024

/** a registered workstation image (test home, then ~/.abox), without building one when there is one */
const workstation = async (): Promise<{ readonly golden: GoldenImage; readonly imagesDir: string }> => {
  for (const imagesDir of [path.join(testHome, "images"), path.join(os.homedir(), ".abox", "images")]) {
    const listed = await Effect.runPromise(listImages(imagesDir))
    const found = listed.images.find((i) => i.meta.variant === "full" && i.meta.arch === "x86_64")
    if (found !== undefined) return { golden: goldenOf(found), imagesDir }
  }
  const skip = workstationSkipReason()
  if (skip !== undefined) throw new Error(`skipped: ${skip}`)
  const golden = await ensureWorkstationImage()
  return { golden, imagesDir: path.join(testHome, "images") }
}

export const vmmClone = async (ctx: BenchContext): Promise<Figure> => {
  const { golden } = await workstation()
  const times: Array<number> = []
  // what stands under it: qemu-img's own process, timed alone on the same golden
  const bare: Array<number> = []
  for (let i = 0; i < ctx.runs + 1; i++) {
    const dir = fs.mkdtempSync(path.join(ctx.tmp, "clone-"))
    const t0 = performance.now()
    const made = await Effect.runPromise(makeRootDisk(golden, dir, true).pipe(Effect.provide(Exec)))
    const t1 = performance.now()
    spawnSync("qemu-img", [
      "create",
      "-q",
      "-f",
      "qcow2",
      "-F",
      "raw",
      "-b",
      golden.rootDisk,
      path.join(dir, "bare.qcow2")
    ])
    const t2 = performance.now()
    if (i > 0) {
      times.push(t1 - t0)
      bare.push(t2 - t1)
    }
    if (made.info.kind === "copy") throw new Error("Open made a full copy: no overlay and no reflink here")
    fs.rmSync(dir, { recursive: true, force: true })
  }
  const ms = median(times)
  return {
    ratio: round(ms / 20),
    medianMs: round(ms, 1),
    floorMs: 20,
    runs: ctx.runs,
    goal: 1.0,
    note: `floor: the 20 ms budget; a bare \`qemu-img create\` of the same overlay took ${round(median(bare), 1)} ms in this run (load ${os.loadavg()[0]!.toFixed(1)}); workstation golden root.raw ${Math.round(allocated(golden.rootDisk) / MiB)} MiB allocated of ${Math.round(fs.statSync(golden.rootDisk).size / MiB)} MiB (a sparse copy took 1.7 s)`
  }
}

/** the 5 main jobs, measured once for the three figures that read them */
let mainJobs:
  | Promise<{ readonly growth: number; readonly own: ReadonlyArray<number>; readonly golden: number }>
  | undefined

const runMainJobs = (ctx: BenchContext) =>
  (mainJobs ??= (async () => {
    const { golden, imagesDir } = await workstation()
    const home = fs.mkdtempSync(path.join(ctx.tmp, "mainjob-home-"))
    // the registry read through a link (never written: --image names the workstation)
    fs.symlinkSync(imagesDir, path.join(home, "images"))
    const env = { ...process.env, ABOX_HOME: home }
    const imageRef = `${golden.identity.name}@${golden.identity.digest}`
    const before = diskUsageSync(path.join(home, "sessions"))
    for (let i = 0; i < 5; i++) {
      const r = spawnSync(
        process.execPath,
        [cli, "run", "--image", imageRef, path.join(repo, "examples", "hello"), "--", "./greet.sh"],
        { env, stdio: ["ignore", "pipe", "pipe"], maxBuffer: 64 * MiB }
      )
      if (r.status !== 0) throw new Error(`abox run exited ${r.status}: ${r.stderr.toString().slice(-800)}`)
    }
    const sessions = path.join(home, "sessions")
    const own = fs
      .readdirSync(sessions)
      .filter((name) => !name.startsWith("."))
      .map((id) => diskUsageSync(path.join(sessions, id)))
    return { growth: diskUsageSync(sessions) - before, own, golden: allocated(golden.rootDisk) }
  })())

export const cowMainJob5 = async (ctx: BenchContext): Promise<Figure> => {
  const jobs = await runMainJobs(ctx)
  return {
    ratio: round(jobs.growth / jobs.golden, 4),
    medianMs: round(jobs.growth / MiB, 1),
    floorMs: round(jobs.golden / MiB, 1),
    runs: 5,
    goal: 0.05,
    note: "MiB, not ms: $ABOX_HOME's growth after 5 `abox run examples/hello -- ./greet.sh` (workstation) over the golden's allocated bytes"
  }
}

export const cowSessionDisk = async (ctx: BenchContext): Promise<Figure> => {
  const jobs = await runMainJobs(ctx)
  const own = median(jobs.own)
  return {
    ratio: round(own / jobs.golden, 4),
    medianMs: round(own / MiB, 2),
    floorMs: round(jobs.golden / MiB, 1),
    runs: jobs.own.length,
    goal: 0.01,
    note: "MiB, not ms: one session's own bytes (its directory: overlay, repository disks, config, logs) after the main job, over the workstation golden's"
  }
}

export const cowSessions20 = async (ctx: BenchContext): Promise<Figure> => {
  const jobs = await runMainJobs(ctx)
  const own = median(jobs.own)
  const twenty = jobs.golden + 20 * own
  const one = jobs.golden + own
  return {
    ratio: round(twenty / one, 3),
    medianMs: round(twenty / MiB, 1),
    floorMs: round(one / MiB, 1),
    runs: jobs.own.length,
    goal: 1.1,
    note: "MiB, not ms: the golden once plus 20 × a session's own bytes (the median of the 5 main jobs), over the golden plus one"
  }
}

/** one boot of the test image on `dir`'s root disk; `body` gets the connection and the VM */
const withVm = <A>(
  golden: GoldenImage,
  dir: string,
  body: (connection: Parameters<typeof runTurn>[0], vmmPid: number) => Effect.Effect<A, unknown, never>
) =>
  Effect.runPromise(
    Effect.gen(function* () {
      const scope = yield* Scope.make()
      const { vm, connection } = yield* bootSession(golden, dir).pipe(Scope.extend(scope))
      const result = yield* body(connection, vm.vmmPid)
      yield* Scope.close(scope, Exit.void)
      return result
    }).pipe(Effect.provide(vmLayer))
  )

const overlayDir = async (ctx: BenchContext, name: string, golden: GoldenImage): Promise<string> => {
  const dir = fs.mkdtempSync(path.join(ctx.tmp, `${name}-`))
  await Effect.runPromise(
    createOverlay("qemu-img", golden.rootDisk, path.join(dir, "root.qcow2")).pipe(
      Effect.provide(NodeCommandExecutor.layer),
      Effect.provide(NodeFileSystem.layer)
    )
  )
  return dir
}

const DD =
  "cd $HOME && dd if=/dev/zero of=dd.bin bs=1M count=256 conv=fsync 2>/dev/null && dd if=dd.bin of=/dev/null bs=1M iflag=direct 2>/dev/null; rm -f dd.bin; sync; echo ok"

export const cowDiskThroughput = async (ctx: BenchContext): Promise<Figure> => {
  const golden = await image()
  const runs = Math.min(ctx.runs, 3)
  const timeTurns = (dir: string) =>
    withVm(golden, dir, (connection) =>
      Effect.gen(function* () {
        const times: Array<number> = []
        for (let i = 0; i < runs + 1; i++) {
          const t0 = performance.now()
          const out = yield* runTurn(connection, DD)
          if (!out.includes("ok")) return yield* Effect.fail(new Error(`dd turn: ${out}`))
          if (i > 0) times.push(performance.now() - t0)
        }
        return median(times)
      })
    )
  const overlay = await timeTurns(await overlayDir(ctx, "dd-qcow2", golden))
  const raw = await timeTurns(freshDir(ctx, "dd-raw", golden))
  return {
    ratio: round(overlay / raw),
    medianMs: round(overlay),
    floorMs: round(raw),
    runs,
    goal: 1.18,
    note: "a turn writing (conv=fsync) then reading (iflag=direct) 256 MiB in /home/agent: overlay root.qcow2 over a raw copy (test image); ≤ 1.18 is ≥ 0.85× the throughput"
  }
}

const vmRssMiB = (pid: number): number =>
  Number(/VmRSS:\s+(\d+)/.exec(fs.readFileSync(`/proc/${pid}/status`, "utf8"))?.[1] ?? 0) / 1024

export const cowIdleRss = async (ctx: BenchContext): Promise<Figure> => {
  const golden = await image()
  const dir = await overlayDir(ctx, "rss", golden)
  const [afterBoot, peak, idle] = await withVm(golden, dir, (connection, pid) =>
    Effect.gen(function* () {
      const afterBoot = vmRssMiB(pid)
      yield* runTurn(connection, "head -c 400m /dev/zero > /tmp/fill; sync")
      const peak = vmRssMiB(pid)
      yield* runTurn(connection, "rm /tmp/fill")
      // free page reporting runs about 2 s after pages are freed
      yield* Effect.sleep("10 seconds")
      return [afterBoot, peak, vmRssMiB(pid)] as const
    })
  )
  return {
    ratio: round(idle / 200),
    medianMs: round(idle, 1),
    floorMs: 200,
    runs: 1,
    goal: 1.0,
    note: `MiB, not ms: QEMU RSS of the idle VM 10 s after its guest freed 400 MiB (tmpfs; test image, -m 1024): ${round(afterBoot, 0)} after boot, ${round(peak, 0)} at the peak`
  }
}
