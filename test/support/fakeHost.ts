/**
 * A minimal protocol v4 host for guest-agent tests: listens on a unix socket, wraps the guest's
 * connection in the real Mux, and queues its control messages so a test can await them in order.
 * It also starts the real guest agent as a child process (the same command FakeVmm uses).
 */
import { spawn, type ChildProcess } from "node:child_process"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { encodeConfigDisk } from "../../src/protocol/ConfigDisk.js"
import type { GuestConfig } from "../../src/protocol/GuestConfig.js"
import type { ControlMessage } from "../../src/protocol/Messages.js"
import { Mux } from "../../src/protocol/Mux.js"
import { guestAgentCommand } from "../../src/layers/FakeVmm.js"

export interface HostConnection {
  readonly mux: Mux
  /** the raw socket under the mux (tests that write malformed bytes) */
  readonly socket: net.Socket
  /** every control message received so far, with its arrival time (ms, performance.now) */
  readonly received: Array<{ readonly at: number; readonly message: ControlMessage }>
  /** the next message not yet taken that matches (messages before it that do not match stay) */
  next<T extends ControlMessage["type"]>(
    type: T,
    timeoutMs?: number
  ): Promise<Extract<ControlMessage, { type: T }>>
  readonly closed: Promise<void>
  /** more handlers for control messages (e.g. a scripted broker answering tunnel_open) */
  readonly listeners: Array<(message: ControlMessage) => void>
}

export const acceptHost = (server: net.Server): Promise<HostConnection> =>
  new Promise((resolve) => {
    server.once("connection", (socket) => {
      const mux = new Mux(socket)
      const received: Array<{ at: number; message: ControlMessage }> = []
      const taken = new Set<number>()
      const waiters: Array<() => void> = []
      const listeners: Array<(message: ControlMessage) => void> = []
      mux.onControl((message) => {
        received.push({ at: performance.now(), message })
        for (const listener of listeners) listener(message)
        for (const wake of waiters.splice(0)) wake()
      })
      const closed = new Promise<void>((done) => mux.onClose(() => done()))
      void closed.then(() => {
        for (const wake of waiters.splice(0)) wake()
      })
      let isClosed = false
      void closed.then(() => {
        isClosed = true
      })
      const next = async <T extends ControlMessage["type"]>(type: T, timeoutMs = 20_000) => {
        const deadline = Date.now() + timeoutMs
        for (;;) {
          const index = received.findIndex((entry, i) => !taken.has(i) && entry.message.type === type)
          if (index >= 0) {
            taken.add(index)
            return received[index]!.message as Extract<ControlMessage, { type: T }>
          }
          if (isClosed) throw new Error(`connection closed while waiting for ${type}`)
          const left = deadline - Date.now()
          if (left <= 0)
            throw new Error(
              `timed out waiting for ${type}; got ${JSON.stringify(received.map((e) => e.message))}`
            )
          await new Promise<void>((wake) => {
            const timer = setTimeout(wake, left)
            waiters.push(() => {
              clearTimeout(timer)
              wake()
            })
          })
        }
      }
      resolve({ mux, socket, received, next, closed, listeners })
    })
  })

export const listenHost = (socketPath: string): Promise<net.Server> =>
  new Promise((resolve, reject) => {
    const server = net.createServer()
    server.once("error", reject)
    server.listen(socketPath, () => resolve(server))
  })

export interface GuestProcess {
  readonly child: ChildProcess
  readonly output: () => string
  readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>
}

export interface GuestDirs {
  readonly root: string
  readonly socket: string
  readonly config: string
  readonly state: string
  readonly repo: string
}

export const makeGuestDirs = (prefix = "abox-guest-"): GuestDirs => {
  const root = fs.mkdtempSync(path.join(os.tmpdir(), prefix))
  return {
    root,
    socket: path.join(root, "rpc.sock"),
    config: path.join(root, "config.raw"),
    state: path.join(root, "state"),
    repo: path.join(root, "repo")
  }
}

export const writeConfig = (dirs: GuestDirs, config: Partial<GuestConfig> = {}): void => {
  fs.writeFileSync(
    dirs.config,
    encodeConfigDisk({ format: 1, sessionId: "test-session", model: "test-model", ...config })
  )
}

export const isRoot = typeof process.getuid === "function" && process.getuid() === 0

export const spawnGuest = (dirs: GuestDirs, extra: ReadonlyArray<string> = []): GuestProcess => {
  const [command, ...prefix] = guestAgentCommand()
  const child = spawn(
    command!,
    [
      ...prefix,
      "--rpc",
      `unix:${dirs.socket}`,
      "--config",
      dirs.config,
      "--state",
      dirs.state,
      "--repo",
      dirs.repo,
      "--run",
      path.join(dirs.root, "run"),
      "--on-shutdown",
      "exit",
      ...(isRoot ? ["--user", "65534:65534"] : []),
      ...extra
    ],
    { stdio: ["ignore", "pipe", "pipe"] }
  )
  let output = ""
  child.stdout!.on("data", (chunk: Buffer) => (output += chunk.toString()))
  child.stderr!.on("data", (chunk: Buffer) => (output += chunk.toString()))
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) =>
    child.once("exit", (code, signal) => resolve({ code, signal }))
  )
  return { child, output: () => output, exited }
}
