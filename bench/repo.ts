/**
 * The repository into a real VM (QEMU; needs the test image): Open's transfer phase against the
 * floor `tar -c | tar -x` of the same tree on the host, measured in the same run. Goal: ≤ 2×.
 * - repoOpenNodeModules: ~7,000 files, ~65 MB, shaped like node_modules (packages, lib/, nested
 *   dependencies, .bin links, package.json/README/LICENSE)
 * - repoOpenTinyFiles: 20,000 files of ~100 bytes in 200 directories
 * - repoOpen200MB: one 200 MB file
 * With repository disks the transfer phase is the host's disk build (scan, mkfs.ext4 -d, owner,
 * overlay); the guest only mounts it at boot. The note gives the boot phase and the whole Open
 * as well, so that nothing moved out of the phase goes unseen.
 */
import * as Effect from "effect/Effect"
import { spawnSync } from "node:child_process"
import * as crypto from "node:crypto"
import * as fs from "node:fs"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import { open, type Phase } from "../src/programs/session.js"
import { benchHome, layerFor } from "./lifecycle.js"
import { image } from "./vmm.js"
import { type BenchContext, type Figure, median, round, timeOnce } from "./lib.js"

/** a node_modules-like tree: ~7k files, ~65 MB */
export const nodeModulesTree = (root: string): string => {
  let seed = 7
  const random = () => {
    seed = (seed * 1103515245 + 12345) & 0x7fffffff
    return seed / 0x7fffffff
  }
  const nm = path.join(root, "node_modules")
  fs.mkdirSync(path.join(nm, ".bin"), { recursive: true })
  fs.writeFileSync(path.join(root, "package.json"), '{ "name": "app", "version": "1.0.0" }\n')
  let files = 0
  for (let p = 0; files < 7000; p++) {
    const pkg = path.join(nm, `pkg-${p}`)
    fs.mkdirSync(path.join(pkg, "lib", "internal"), { recursive: true })
    fs.writeFileSync(path.join(pkg, "package.json"), `{ "name": "pkg-${p}", "main": "lib/index.js" }\n`)
    fs.writeFileSync(path.join(pkg, "README.md"), `# pkg-${p}\n`.repeat(40))
    fs.writeFileSync(path.join(pkg, "LICENSE"), "MIT License\n".repeat(20))
    files += 3
    const count = 4 + Math.floor(random() * 30)
    for (let f = 0; f < count; f++) {
      // sizes like real sources: mostly small, some large (mean ~9 KB)
      const size = Math.floor(-Math.log(1 - random()) * 9000)
      const body = crypto
        .randomBytes(Math.ceil(size / 2))
        .toString("hex")
        .slice(0, size)
      fs.writeFileSync(path.join(pkg, f % 3 === 0 ? "lib/internal" : "lib", `m${f}.js`), body)
      files++
    }
    if (p % 10 === 0) {
      fs.writeFileSync(path.join(pkg, "cli.js"), "#!/usr/bin/env node\n", { mode: 0o755 })
      fs.symlinkSync(`../pkg-${p}/cli.js`, path.join(nm, ".bin", `pkg-${p}`))
      files += 2
    }
  }
  return root
}

export const tinyFilesTree = (root: string): string => {
  for (let d = 0; d < 200; d++) {
    const dir = path.join(root, `d${d}`)
    fs.mkdirSync(dir, { recursive: true })
    for (let f = 0; f < 100; f++) fs.writeFileSync(path.join(dir, `f${f}.txt`), `file ${d}/${f}\n`.repeat(8))
  }
  return root
}

export const bigFileTree = (root: string): string => {
  fs.mkdirSync(root, { recursive: true })
  const fd = fs.openSync(path.join(root, "big.bin"), "w")
  const chunk = crypto.randomBytes(1024 * 1024)
  for (let i = 0; i < 200; i++) {
    chunk.writeUInt32LE(i, 0)
    fs.writeSync(fd, chunk)
  }
  fs.closeSync(fd)
  return root
}

interface OpenTimes {
  readonly transferMs: number
  readonly bootMs: number
  readonly openMs: number
}

/** one Open of `tree` on the real backend, closed again: the phases' durations */
const openOnce = (ctx: BenchContext, tree: string): Promise<OpenTimes> =>
  Effect.runPromise(
    Effect.scoped(
      Effect.gen(function* () {
        const marks: Array<[Phase, number]> = []
        const t0 = performance.now()
        const onPhase = (phase: Phase) => Effect.sync(() => void marks.push([phase, performance.now()]))
        yield* open({ source: tree, onPhase })
        const end = performance.now()
        const duration = (phase: Phase) => {
          const i = marks.findIndex(([p]) => p === phase)
          if (i < 0) return 0
          return (marks[i + 1]?.[1] ?? end) - marks[i]![1]
        }
        return { transferMs: duration("transfer"), bootMs: duration("boot"), openMs: end - t0 }
      })
    ).pipe(Effect.provide(layerFor(benchHome(ctx, "repo"), false)))
  )

const figureFor = async (ctx: BenchContext, make: (root: string) => string): Promise<Figure> => {
  await image()
  const tree = make(fs.mkdtempSync(path.join(ctx.tmp, "repo-tree-")))
  // every measurement starts with no dirty pages from the one before (the tree just written,
  // the previous copy): the kernel's write-back throttling would otherwise land on whoever
  // writes next
  const settle = () => void spawnSync("sync")
  const tarMs = () => {
    settle()
    const target = fs.mkdtempSync(path.join(ctx.tmp, "untar-"))
    const ms = timeOnce(["sh", "-c", `tar -C '${tree}' -cf - . | tar -C '${target}' -xf -`])
    fs.rmSync(target, { recursive: true, force: true })
    return ms
  }
  // a VM per run: few runs (each boots under TCG), the floor as often as the rest of the bench
  const runs = Math.min(ctx.runs, 3)
  tarMs()
  const opens: Array<OpenTimes> = []
  const floor: Array<number> = []
  for (let i = 0; i < runs; i++) {
    settle()
    opens.push(await openOnce(ctx, tree))
    floor.push(tarMs())
  }
  const medianMs = median(opens.map((o) => o.transferMs))
  const floorMs = median(floor)
  fs.rmSync(tree, { recursive: true, force: true })
  return {
    ratio: round(medianMs / floorMs),
    medianMs: round(medianMs),
    floorMs: round(floorMs),
    runs,
    goal: 2,
    note:
      `ratio = Open's transfer phase / tar | tar (lower is better); ` +
      `boot phase ${round(median(opens.map((o) => o.bootMs)) / 1000, 1)} s, ` +
      `whole Open ${round(median(opens.map((o) => o.openMs)) / 1000, 1)} s under TCG`
  }
}

export const repoOpenNodeModules = (ctx: BenchContext) => figureFor(ctx, nodeModulesTree)
export const repoOpenTinyFiles = (ctx: BenchContext) => figureFor(ctx, tinyFilesTree)
export const repoOpen200MB = (ctx: BenchContext) => figureFor(ctx, bigFileTree)
