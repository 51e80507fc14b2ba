/**
 * turnOutputStream (real VM, the built CLI as a whole process): `abox run <repo> -- seq 1 6000000
 * > file` (47 MB of output). Measured from the host while it runs: the output's streaming time
 * (its first byte in the file to its last, polling the file's size) and the CLI process's peak
 * RSS (VmHWM of that one process, polled from /proc: not QEMU's, not the helper's).
 * The floor is ssh-like, in the same run: the same bytes made by the same guest (a run of
 * `seq 1 6000000 | cat > /dev/null` in a VM, timed between two marker lines: what the guest
 * takes to produce and move the bytes between two of its processes) plus the same bytes over a
 * raw unix socket between two host processes into a file (`seq | node → socket → node → file`).
 * ratio = throughput vs that floor (goal ≥ 0.5); `peakRssMiB` ≤ 150 whatever the output's size.
 */
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import { benchHome } from "./lifecycle.js"
import { type BenchContext, cli, type Figure, median, round } from "./lib.js"
import { image } from "./vmm.js"

const COUNT = 6_000_000
/** the bytes of `seq 1 COUNT` */
const seqBytes = (count: number): number => {
  let total = 0
  for (let digits = 1, low = 1; low <= count; digits++, low *= 10) {
    total += (Math.min(count, low * 10 - 1) - low + 1) * (digits + 1)
  }
  return total
}

interface Watched {
  /** ms from the first byte in `out` to the last (or between the marker lines) */
  readonly streamMs: number
  /** the CLI process's VmHWM, KiB */
  readonly hwmKiB: number
  readonly size: number
}

/** runs the CLI with stdout to `out`, polling the file's size and the process's VmHWM */
const watchRun = (
  argv: ReadonlyArray<string>,
  env: Record<string, string>,
  out: string,
  markers?: { readonly start: string; readonly end: string }
): Promise<Watched> =>
  new Promise((resolve, reject) => {
    const fd = fs.openSync(out, "w")
    const child = spawn(argv[0]!, argv.slice(1), {
      env: { ...process.env, ...env },
      stdio: ["ignore", fd, "pipe"]
    })
    fs.closeSync(fd)
    let stderr = ""
    child.stderr?.on("data", (chunk: Buffer) => void (stderr += chunk.toString()))
    let first: number | undefined
    let last = 0
    let size = 0
    let hwm = 0
    const poll = () => {
      try {
        const status = fs.readFileSync(`/proc/${child.pid}/status`, "utf8")
        const match = /VmHWM:\s+(\d+)/.exec(status)
        if (match !== null) hwm = Math.max(hwm, Number(match[1]))
      } catch {
        // gone
      }
      const now = performance.now()
      const grown = fs.statSync(out).size
      if (markers === undefined) {
        if (grown > 0 && first === undefined) first = now
        if (grown > size) last = now
      } else if (grown > size) {
        const text = fs.readFileSync(out, "utf8")
        if (first === undefined && text.includes(markers.start)) first = now
        if (text.includes(markers.end)) last = now
      }
      size = grown
    }
    const timer = setInterval(poll, 10)
    child.once("error", reject)
    child.once("exit", (code) => {
      clearInterval(timer)
      poll()
      if (code !== 0) return reject(new Error(`${argv.join(" ")} exited ${code}: ${stderr}`))
      if (first === undefined) return reject(new Error(`no output from ${argv.join(" ")}`))
      resolve({ streamMs: last - first, hwmKiB: hwm, size })
    })
  })

/** the same bytes through a raw unix socket between two host processes, into a file (ms) */
const rawSocketMs = (dir: string, count: number): Promise<number> =>
  new Promise((resolve, reject) => {
    const socket = path.join(dir, "raw.sock")
    const out = path.join(dir, "raw.out")
    fs.rmSync(socket, { force: true })
    const receiver = `const net=require("net"),fs=require("fs");const s=net.createServer(c=>{c.pipe(fs.createWriteStream(process.argv[2])).on("finish",()=>process.exit(0))}).listen(process.argv[1],()=>process.stdout.write("up"))`
    const sender = `require("net").connect(process.argv[1],function(){process.stdin.pipe(this)})`
    const recv = spawn(process.execPath, ["-e", receiver, socket, out], {
      stdio: ["ignore", "pipe", "inherit"]
    })
    recv.stdout.once("data", () => {
      const start = performance.now()
      const send = spawn("sh", ["-c", `seq 1 ${count} | "${process.execPath}" -e '${sender}' "${socket}"`], {
        stdio: "inherit"
      })
      send.once("error", reject)
      recv.once("exit", (code) => {
        const ms = performance.now() - start
        if (code !== 0 || fs.statSync(out).size !== seqBytes(count))
          return reject(new Error("raw socket copy failed"))
        resolve(ms)
      })
    })
    recv.once("error", reject)
  })

export const turnOutputStream = async (ctx: BenchContext): Promise<Figure> => {
  await image()
  const runs = Math.min(ctx.runs, 3)
  const home = benchHome(ctx, "stream")
  const repo = fs.mkdtempSync(path.join(ctx.tmp, "stream-repo-"))
  fs.writeFileSync(path.join(repo, "README.md"), "bench\n")
  const out = path.join(ctx.tmp, "stream.out")
  const env = { ABOX_HOME: home }
  const ours = () =>
    watchRun([process.execPath, cli, "run", "--rm", repo, "--", "seq", "1", String(COUNT)], env, out)
  const guestFloor = () =>
    watchRun(
      [
        process.execPath,
        cli,
        "run",
        "--rm",
        repo,
        "--",
        `echo floor-start; seq 1 ${COUNT} | cat > /dev/null; echo floor-end`
      ],
      env,
      out,
      { start: "floor-start", end: "floor-end" }
    )
  const expected = seqBytes(COUNT)
  const streams: Array<number> = []
  const floors: Array<number> = []
  const rss: Array<number> = []
  const raws: Array<number> = []
  for (let i = 0; i < runs; i++) {
    const run = await ours()
    if (run.size !== expected) throw new Error(`abox run wrote ${run.size} bytes, not ${expected}`)
    streams.push(run.streamMs)
    rss.push(run.hwmKiB / 1024)
    const guest = await guestFloor()
    const raw = await rawSocketMs(ctx.tmp, COUNT)
    raws.push(raw)
    floors.push(guest.streamMs + raw)
  }
  const medianMs = median(streams)
  const floorMs = median(floors)
  const peakRssMiB = round(Math.max(...rss), 1)
  return {
    ratio: round(floorMs / medianMs),
    medianMs: round(medianMs),
    floorMs: round(floorMs),
    runs,
    goal: 0.5,
    peakRssMiB,
    note:
      `throughput vs an ssh-like floor (ratio = floor ms / ours ms): ${round(expected / 1e6 / (medianMs / 1000))} MB/s through ` +
      `abox run > file (first byte to last); floor = the guest's own seq | cat > /dev/null ` +
      `(${round(floorMs - median(raws))} ms) + the bytes over a raw unix socket between two host processes ` +
      `(${round(median(raws))} ms); CLI peak RSS ${peakRssMiB} MiB (VmHWM of the CLI process; goal ≤ 150)`
  }
}
