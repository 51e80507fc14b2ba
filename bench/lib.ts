import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import { encodeConfigDisk } from "../src/protocol/ConfigDisk.js"

export const repo = path.resolve(import.meta.dirname, "..")
export const cli = path.join(repo, "dist", "abox.js")

/** what a figure gets from run.ts; a figure is `(ctx) => Promise<Figure>` */
export interface BenchContext {
  /** timed runs per measurement (the median is reported) */
  readonly runs: number
  /** a temp dir removed after the run */
  readonly tmp: string
}

/** a ratio against a floor measured in the same run, with the raw medians */
export interface Figure {
  readonly ratio: number
  readonly medianMs: number
  readonly floorMs: number
  readonly runs: number
  readonly goal?: number
  readonly note?: string
  /** a memory figure measured alongside (MiB) */
  readonly peakRssMiB?: number
}

export const median = (xs: ReadonlyArray<number>): number => {
  const s = [...xs].sort((a, b) => a - b)
  const mid = Math.floor(s.length / 2)
  return s.length % 2 === 1 ? s[mid]! : (s[mid - 1]! + s[mid]!) / 2
}

/** wall time of one process run, in ms; fails loudly if the command fails */
export const timeOnce = (argv: ReadonlyArray<string>, env: Record<string, string> = {}): number => {
  const start = performance.now()
  const r = spawnSync(argv[0]!, argv.slice(1), {
    env: { ...process.env, ...env },
    stdio: ["ignore", "pipe", "pipe"],
    maxBuffer: 256 * 1024 * 1024
  })
  const ms = performance.now() - start
  if (r.status !== 0) throw new Error(`${argv.join(" ")} exited ${r.status}: ${r.stderr.toString()}`)
  return ms
}

/** median of `runs` timed runs after one warm-up; alternating a and b so drift hits both alike */
export const compare = (
  runs: number,
  a: () => number,
  b: () => number
): { readonly a: number; readonly b: number } => {
  a()
  b()
  const as: Array<number> = []
  const bs: Array<number> = []
  for (let i = 0; i < runs; i++) {
    as.push(a())
    bs.push(b())
  }
  return { a: median(as), b: median(bs) }
}

export const round = (x: number, digits = 2) => Math.round(x * 10 ** digits) / 10 ** digits

/** the Figure of a `compare`: its first median over its second (the floor) */
export const comparedFigure = (
  m: { readonly a: number; readonly b: number },
  runs: number,
  extra: Pick<Figure, "goal" | "note"> = {}
): Figure => ({
  ratio: round(m.a / m.b),
  medianMs: round(m.a, 1),
  floorMs: round(m.b, 1),
  runs,
  ...extra
})

/**
 * An ABOX_HOME with `count` sessions as abox writes them: session.json, guest-config.json and
 * config.raw (secretless), dirs 0700, files 0600.
 */
export const makeHome = (root: string, count: number): string => {
  const home = path.join(root, `home-${count}`)
  if (fs.existsSync(home)) return home
  const sessions = path.join(home, "sessions")
  fs.mkdirSync(sessions, { recursive: true, mode: 0o700 })
  const t0 = Date.UTC(2026, 0, 1)
  for (let i = 0; i < count; i++) {
    const id = `01j${i.toString(32).padStart(23, "0")}`
    const dir = path.join(sessions, id)
    fs.mkdirSync(dir, { mode: 0o700 })
    const config = { format: 1 as const, sessionId: id, model: "default" }
    const meta = {
      format: 1,
      id,
      created: new Date(t0 + i * 1000).toISOString(),
      source: `/home/user/src/project-${i % 37}`,
      model: "default",
      image: { name: "debian", digest: "sha256-" + "ab".repeat(32) },
      guest: { arch: "x86_64", protocol: 4 },
      vmm: { backend: "qemu" },
      resources: { cpus: 2, memoryMiB: 2048 }
    }
    fs.writeFileSync(path.join(dir, "session.json"), JSON.stringify(meta, null, 2) + "\n", { mode: 0o600 })
    fs.writeFileSync(path.join(dir, "guest-config.json"), JSON.stringify(config, null, 2) + "\n", {
      mode: 0o600
    })
    fs.writeFileSync(path.join(dir, "config.raw"), encodeConfigDisk(config), { mode: 0o600 })
  }
  return home
}

export const tempRoot = () => fs.mkdtempSync(path.join(os.tmpdir(), "abox-bench-"))
