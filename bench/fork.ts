/**
 * Fork and resume figures (the built CLI, whole processes, the busybox test image under TCG):
 * - suspendResume: `abox start` of a suspended session then its first turn (`exec -- true`),
 *   against the same after a plain `stop` (a cold boot of the same session); goal ≤ 0.3
 * - forkVsOpen: `abox fork` of a running (detached) session, against `abox start <dir>` (an
 *   Open of the same repository, to ready); goal ≤ 0.25
 * - forkDisk: the bytes 10 forks of one session add (their overlays, and the parent's new ones;
 *   state files aside), over the golden's allocated bytes; goal ≤ 0.10
 */
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import { testHome } from "../test/e2e-vm-image.js"
import { type BenchContext, type Figure, cli, median, round } from "./lib.js"
import { image } from "./vmm.js"

const MiB = 1024 * 1024

const setup = async (ctx: BenchContext, name: string) => {
  const golden = await image()
  const home = fs.mkdtempSync(path.join(ctx.tmp, `${name}-`))
  fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
  const repo = fs.mkdtempSync(path.join(ctx.tmp, `${name}-repo-`))
  fs.writeFileSync(path.join(repo, "README.md"), "bench\n")
  const abox = (args: ReadonlyArray<string>) => {
    const t0 = performance.now()
    const r = spawnSync(process.execPath, [cli, ...args], {
      env: { ...process.env, ABOX_HOME: home },
      encoding: "utf8",
      timeout: 600_000
    })
    if (r.status !== 0) throw new Error(`abox ${args.join(" ")} exited ${r.status}: ${r.stderr}`)
    return { ms: performance.now() - t0, stdout: r.stdout }
  }
  const stopAll = () => {
    for (const id of fs.readdirSync(path.join(home, "sessions")))
      spawnSync(process.execPath, [cli, "stop", id], { env: { ...process.env, ABOX_HOME: home } })
  }
  return { golden, home, repo, abox, stopAll }
}

export const suspendResume = async (ctx: BenchContext): Promise<Figure> => {
  const { repo, abox, stopAll } = await setup(ctx, "suspend")
  const runs = Math.max(3, Math.min(ctx.runs, 5))
  try {
    abox(["start", repo, "--name", "s", "--memory", "512"])
    const warm: Array<number> = []
    const cold: Array<number> = []
    for (let i = 0; i < runs; i++) {
      abox(["suspend", "s"])
      warm.push(abox(["start", "s"]).ms + abox(["exec", "s", "--", "true"]).ms)
      abox(["stop", "s"])
      cold.push(abox(["start", "s"]).ms + abox(["exec", "s", "--", "true"]).ms)
    }
    const medianMs = median(warm)
    const floorMs = median(cold)
    return {
      ratio: round(medianMs / floorMs, 3),
      medianMs: round(medianMs, 0),
      floorMs: round(floorMs, 0),
      runs,
      goal: 0.3,
      note: "start + first turn of a suspended session (restore) over the same after a plain stop (cold boot)"
    }
  } finally {
    stopAll()
  }
}

export const forkVsOpen = async (ctx: BenchContext): Promise<Figure> => {
  const { repo, abox, stopAll } = await setup(ctx, "fork")
  const runs = Math.max(3, Math.min(ctx.runs, 5))
  try {
    abox(["start", repo, "--name", "p", "--memory", "512"])
    abox(["exec", "p", "--", "true"])
    const forks: Array<number> = []
    const opens: Array<number> = []
    for (let i = 0; i < runs; i++) {
      forks.push(abox(["fork", "p", "--name", `f${i}`]).ms)
      opens.push(abox(["start", repo, "--name", `o${i}`, "--memory", "512"]).ms)
      abox(["stop", `o${i}`])
    }
    const medianMs = median(forks)
    const floorMs = median(opens)
    return {
      ratio: round(medianMs / floorMs, 3),
      medianMs: round(medianMs, 0),
      floorMs: round(floorMs, 0),
      runs,
      goal: 0.25,
      note: "abox fork of a running detached session over abox start <dir> (an Open of the same repository, to ready)"
    }
  } finally {
    stopAll()
  }
}

export const forkDisk = async (ctx: BenchContext): Promise<Figure> => {
  const { golden, home, repo, abox, stopAll } = await setup(ctx, "forkdisk")
  try {
    const parent = abox(["start", repo, "--name", "p", "--memory", "512", "--json"])
    const parentId = (JSON.parse(parent.stdout) as { session: string }).session
    abox(["exec", "p", "--", "true"])
    // each inode once: a frozen layer is a second name of a disk that was there before
    const qcow2Bytes = (dirs: ReadonlyArray<string>) => {
      const seen = new Map<number, number>()
      for (const dir of dirs)
        for (const f of fs.readdirSync(dir).filter((name) => name.endsWith(".qcow2"))) {
          const stat = fs.statSync(path.join(dir, f))
          seen.set(stat.ino, stat.blocks * 512)
        }
      return [...seen.values()].reduce((a, b) => a + b, 0)
    }
    const parentDir = path.join(home, "sessions", parentId)
    const before = qcow2Bytes([parentDir])
    const children: Array<string> = []
    for (let i = 0; i < 10; i++) {
      const forked = abox(["fork", "p", "--name", `f${i}`, "--json"])
      children.push((JSON.parse(forked.stdout) as { session: { id: string } }).session.id)
    }
    const added = qcow2Bytes([parentDir, ...children.map((id) => path.join(home, "sessions", id))]) - before
    const goldenBytes = fs.statSync(golden.rootDisk).blocks * 512
    return {
      ratio: round(added / goldenBytes, 4),
      medianMs: round(added / MiB, 2),
      floorMs: round(goldenBytes / MiB, 1),
      runs: 1,
      goal: 0.1,
      note: "MiB, not ms: what 10 forks of a running session add in qcow2 files (their overlays, the parent's new overlays; frozen layers are the parent's disks, hard links; state files aside), over the golden's allocated bytes"
    }
  } finally {
    stopAll()
  }
}
