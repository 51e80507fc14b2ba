/**
 * abox-vmm: owns one VMM process for its supervisor (the QemuVmm layer).
 *
 *   stdin   one HelperSpec JSON line (src/vmm/protocol.ts)
 *   stdout  HelperEvent JSON lines: started {pid}, stopping {reason}, exited {code, signal}
 *   fd 3    liveness pipe: EOF = the supervisor died → bounded stop of the VMM, then exit
 *   fd 4    the session's locked fd, passed on to the VMM (the lock lives as long as the VM)
 *
 * SIGTERM (Linux) / SIGINT (macOS) → the same bounded stop: QMP quit (QEMU) or REST Stop, HardStop
 * (vfkit) → wait → the fallback signal (`spec.signal`, default SIGTERM) → wait →
 * SIGKILL; the VMM is always reaped before the helper exits.
 *
 * Exit codes: 0 after `exited`; 64 a bad spec (an `error` event says why); 69 the VMM could not
 * be started (an `error` event); 70 no spec on stdin or an unexpected failure (on stderr).
 *
 * Plain node, no Effect runtime: the helper lives as long as the session, beside the CLI, and
 * its memory counts against the session's (docs/performance.md, `lifecycleRss`). It is one
 * sequence of callbacks around one child process; the protocol decoder it shares with the
 * supervisor (src/vmm/protocol.ts) is plain TypeScript too.
 */
// Raw node:child_process / node:net / node:fs: the VMM must inherit fd 4 (the lock) and the
// helper must read fd 3 (liveness).
import { spawn, type ChildProcess } from "node:child_process"
import * as fs from "node:fs"
import * as net from "node:net"
import { BoundedConsole } from "./console.js"
import { qmpCommand } from "./qmp.js"
import { vfkitRequest } from "./vfkitRest.js"
import {
  decodeHelperSpec,
  encodeHelperEvent,
  type HelperEvent,
  type HelperSpec,
  LIVENESS_FD,
  LOCK_FD
} from "./protocol.js"
import { errorMessage } from "../domain/errorMessage.js"

// the supervisor may be gone: writes to its pipes must never crash the helper
process.stdout.on("error", () => undefined)
process.stderr.on("error", () => undefined)

const emit = (event: HelperEvent) => {
  process.stdout.write(encodeHelperEvent(event) + "\n")
}

/** the first line on stdin (or all of it, when it ends without a newline); undefined: nothing */
const readStdinLine = (): Promise<string | undefined> =>
  new Promise((resolve) => {
    let text = ""
    process.stdin.setEncoding("utf8")
    const onData = (chunk: string) => {
      text += chunk
      const newline = text.indexOf("\n")
      if (newline !== -1) {
        process.stdin.off("data", onData)
        process.stdin.pause()
        resolve(text.slice(0, newline))
      }
    }
    process.stdin.on("data", onData)
    process.stdin.on("end", () => resolve(text.trim() === "" ? undefined : text))
  })

const fdOpen = (fd: number): boolean => {
  try {
    fs.fstatSync(fd)
    return true
  } catch {
    return false
  }
}

interface Exit {
  readonly code: number | null
  readonly signal: string | null
}

/** a promise and the function that settles it (once) */
const settable = <A>() => {
  let settle!: (value: A) => void
  let settled = false
  const promise = new Promise<A>((resolve) => {
    settle = (value) => {
      if (settled) return
      settled = true
      resolve(value)
    }
  })
  return { promise, settle: (value: A) => settle(value), isSettled: () => settled }
}

/** true when `promise` settles within `ms`, false otherwise (the timer never outlives the wait) */
const within = (promise: Promise<unknown>, ms: number): Promise<boolean> =>
  new Promise((resolve) => {
    const timer = setTimeout(() => resolve(false), ms)
    void promise.then(() => {
      clearTimeout(timer)
      resolve(true)
    })
  })

/**
 * The bounded stop: QMP quit / vfkit Stop, HardStop → wait → the fallback signal → wait →
 * SIGKILL → wait for the exit. Each step runs only while the VMM has not exited yet.
 */
const stopSequence = async (
  spec: HelperSpec,
  child: ChildProcess,
  exited: Promise<Exit>,
  hasExited: () => boolean
) => {
  const waitFor = (ms: number) => within(exited, ms)
  if (spec.qmpSocket !== undefined) {
    await qmpCommand(spec.qmpSocket, "quit", spec.quitMs).catch(() => undefined)
    if (await waitFor(spec.quitMs)) return
  }
  if (spec.restSocket !== undefined) {
    // vfkit: Stop asks the guest (RequestStop); HardStop stops the VM without asking
    for (const state of ["Stop", "HardStop"] as const) {
      if (hasExited()) return
      await within(
        vfkitRequest({
          socket: spec.restSocket,
          method: "POST",
          route: "/vm/state",
          body: JSON.stringify({ state }),
          signal: AbortSignal.timeout(spec.quitMs)
        }).catch(() => undefined),
        spec.quitMs
      )
      if (await waitFor(spec.quitMs)) return
    }
  }
  if (hasExited()) return
  child.kill(spec.signal ?? "SIGTERM")
  if (await waitFor(spec.termMs)) return
  child.kill("SIGKILL")
  await exited
}

/** resolves once both of the VMM's output pipes have closed (what it wrote last is in the log) */
const drained = (child: ChildProcess): Promise<void> =>
  new Promise((resolve) => {
    let open = 2
    const done = () => {
      open -= 1
      if (open === 0) resolve()
    }
    if (child.stdout === null || child.stdout.readableEnded) done()
    else child.stdout.once("close", done)
    if (child.stderr === null || child.stderr.readableEnded) done()
    else child.stderr.once("close", done)
  })

const main = async (): Promise<number> => {
  const line = await readStdinLine()
  if (line === undefined) throw new Error("no spec on stdin")
  const decoded = decodeHelperSpec(line)
  if (!decoded.ok) {
    emit({ event: "error", message: `bad spec: ${decoded.error}` })
    return 64
  }
  const spec = decoded.value
  const console = new BoundedConsole(spec.consoleLog, spec.consoleMaxBytes)
  const exited = settable<Exit>()
  const stop = settable<string>()
  const spawnError = settable<string>()

  // what the VMM creates (QEMU's qmp.sock, vfkit's REST socket) is the owner's alone (0600,
  // docs/on-disk.md): they bind their sockets under the umask they inherit
  process.umask(0o177)
  const child = spawn(spec.command, [...spec.args], {
    env: spec.env,
    // fd 3 is a fresh pipe so the VMM never holds our liveness fd; fd 4 is the lock
    stdio: ["ignore", "pipe", "pipe", "pipe", fdOpen(LOCK_FD) ? LOCK_FD : "ignore"]
  })
  child.on("error", (error) => spawnError.settle(error.message))
  child.stdout?.on("data", (chunk: Buffer) => console.write(chunk))
  child.stderr?.on("data", (chunk: Buffer) => console.write(chunk))
  child.on("exit", (code, signal) => exited.settle({ code, signal }))

  if (child.pid === undefined) {
    const message = await spawnError.promise
    emit({ event: "error", message: `cannot start ${spec.command}: ${message}` })
    console.close()
    return 69
  }
  emit({ event: "started", pid: child.pid })

  // liveness: EOF (or error) on fd 3 means the supervisor is gone
  if (fdOpen(LIVENESS_FD)) {
    const liveness = new net.Socket({ fd: LIVENESS_FD, readable: true, writable: false })
    liveness.on("data", () => undefined)
    const gone = () => stop.settle("supervisor gone")
    liveness.on("end", gone)
    liveness.on("close", gone)
    liveness.on("error", gone)
  }
  const onSignal = (signal: NodeJS.Signals) => stop.settle(signal)
  const fallback = spec.signal ?? (process.platform === "darwin" ? "SIGINT" : "SIGTERM")
  process.on("SIGTERM", onSignal)
  process.on("SIGINT", process.platform === "darwin" || fallback === "SIGINT" ? onSignal : () => undefined)
  process.on("SIGHUP", () => undefined)

  // the stop runs once asked for, and stops at its next step once the VMM has exited
  void stop.promise.then((reason) => {
    if (exited.isSettled()) return
    emit({ event: "stopping", reason })
    return stopSequence(spec, child, exited.promise, exited.isSettled)
  })
  const exit = await exited.promise
  // drain what the VMM wrote last (bounded)
  await within(drained(child), 1000)
  console.close()
  emit({ event: "exited", code: exit.code, signal: exit.signal })
  return 0
}

// the entry point of its own process
main().then(
  (code) => process.exit(code),
  (error: unknown) => {
    process.stderr.write(`abox-vmm: ${errorMessage(error)}\n`)
    process.exit(70)
  }
)
