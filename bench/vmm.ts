/**
 * VMM figures (need qemu-system-x86_64 and the test image, built on first use):
 * - vmmOpenToHello: QemuVmm.start + GuestRpc accept (hello) vs a bare QEMU boot of the same
 *   image to its first serial line from init (`abox-init: started`); goal ≤ 1.10
 * - vmmClone: bench/cow.ts (Open's root disk from the workstation golden)
 * - vmmRss: supervisor + helper RSS (MiB) while a VM runs, against 120 MiB; goal ≤ 1.0
 */
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Scope from "effect/Scope"
import { spawn, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as net from "node:net"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import type { GoldenImage } from "../src/domain/image.js"
import { buildQemuArgv, minimalEnv } from "../src/vmm/argv.js"
import { bootSession, ensureTestImage, vmLayer, vmSkipReason } from "../test/e2e-vm-image.js"
import { type BenchContext, type Figure, median, round } from "./lib.js"

const Live = vmLayer

export const image = async (): Promise<GoldenImage> => {
  const skip = vmSkipReason()
  if (skip !== undefined) throw new Error(`skipped: ${skip}`)
  return ensureTestImage()
}

export const freshDir = (ctx: BenchContext, name: string, golden: GoldenImage): string => {
  const dir = fs.mkdtempSync(path.join(ctx.tmp, `${name}-`))
  spawnSync("cp", ["--reflink=auto", "--sparse=always", golden.rootDisk, path.join(dir, "root.raw")])
  fs.chmodSync(path.join(dir, "root.raw"), 0o600)
  return dir
}

/** one abox boot: start → hello, then Close; returns [ms to hello, supervisor+helper RSS MiB] */
const aboxBoot = (golden: GoldenImage, dir: string) =>
  Effect.runPromise(
    Effect.gen(function* () {
      const scope = yield* Scope.make()
      const t0 = performance.now()
      const { vm } = yield* bootSession(golden, dir).pipe(Scope.extend(scope))
      const ms = performance.now() - t0
      const helperRss = Number(
        /VmRSS:\s+(\d+)/.exec(fs.readFileSync(`/proc/${vm.helperPid}/status`, "utf8"))?.[1] ?? 0
      )
      const rssMiB = process.memoryUsage().rss / 1024 / 1024 + helperRss / 1024
      yield* Scope.close(scope, Exit.void)
      return [ms, rssMiB] as const
    }).pipe(Effect.provide(Live))
  )

/** the floor: the same QEMU command line, timed to init's first serial line */
export const bareBoot = async (golden: GoldenImage, dir: string, accel: "kvm" | "tcg"): Promise<number> => {
  const rpcSocket = path.join(dir, "bare-rpc.sock")
  fs.rmSync(rpcSocket, { force: true })
  const server = net.createServer(() => undefined).listen(rpcSocket)
  await new Promise((resolve) => server.once("listening", resolve))
  fs.writeFileSync(path.join(dir, "config.raw"), Buffer.alloc(4096))
  const argv = buildQemuArgv({
    arch: golden.arch,
    accel,
    kernel: golden.kernel,
    initrd: golden.initrd,
    rootDisk: path.join(dir, "root.raw"),
    configDisk: path.join(dir, "config.raw"),
    rpcSocket,
    qmpSocket: path.join(dir, "bare-qmp.sock"),
    cpus: 2,
    memoryMiB: 1024
  })
  const t0 = performance.now()
  const qemu = spawn("qemu-system-x86_64", argv, { env: minimalEnv(), stdio: ["ignore", "pipe", "pipe"] })
  const ms = await new Promise<number>((resolve, reject) => {
    let seen = ""
    qemu.stdout.on("data", (chunk: Buffer) => {
      seen += chunk.toString("utf8")
      if (seen.includes("abox-init: started")) resolve(performance.now() - t0)
    })
    qemu.on("exit", (code) => reject(new Error(`bare qemu exited ${code} before init`)))
  })
  qemu.kill("SIGKILL")
  await new Promise((resolve) => qemu.once("exit", resolve))
  server.close()
  return ms
}

export const accelInUse = (): "kvm" | "tcg" => (process.env.ABOX_QEMU_ACCEL === "kvm" ? "kvm" : "tcg")

export const vmmOpenToHello = async (ctx: BenchContext): Promise<Figure> => openToHello(ctx, await image())

/** start → hello of `golden` against its bare boot (any registered image, e.g. one without a snapshot) */
export const openToHello = async (ctx: BenchContext, golden: GoldenImage): Promise<Figure> => {
  const runs = Math.min(ctx.runs, 3)
  const dir = freshDir(ctx, "boot", golden)
  const accel = accelInUse()
  await aboxBoot(golden, dir)
  await bareBoot(golden, dir, accel)
  const a: Array<number> = []
  const b: Array<number> = []
  for (let i = 0; i < runs; i++) {
    a.push((await aboxBoot(golden, dir))[0])
    b.push(await bareBoot(golden, dir, accel))
  }
  const medianMs = median(a)
  const floorMs = median(b)
  return {
    ratio: round(medianMs / floorMs),
    medianMs: round(medianMs),
    floorMs: round(floorMs),
    runs,
    goal: 1.1,
    note: `abox: start → guest hello; floor: bare qemu → 'abox-init: started' (${accel}); the hello includes the agent's node start-up`
  }
}

export const vmmRss = async (ctx: BenchContext): Promise<Figure> => {
  const golden = await image()
  const dir = freshDir(ctx, "rss", golden)
  const [, rss] = await aboxBoot(golden, dir)
  return {
    ratio: round(rss / 120),
    medianMs: round(rss),
    floorMs: 120,
    runs: 1,
    goal: 1.0,
    note: "MiB, not ms: supervisor (this process) + abox-vmm RSS with a VM running"
  }
}
