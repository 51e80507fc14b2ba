/**
 * Opens the guest's end of the host RPC byte stream.
 * - `auto`: the virtio-serial port whose /sys/class/virtio-ports/<port>/name reads `abox.rpc`
 *   (QEMU), else vsock port 1024 (Virtualization.framework).
 * - `unix:PATH`: a unix socket (FakeVmm: the host's rpc.sock).
 * - `/dev/vportNpM`: a virtio-serial port device.
 * - `vsock:PORT`: Node has no AF_VSOCK; the bytes go through `socat` (must be in the image), the
 *   connect retried until it succeeds (vfkit listens only once the VM is Running).
 */
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import * as fsp from "node:fs/promises"
import * as net from "node:net"
import * as path from "node:path"
import { Duplex } from "node:stream"
import type { RpcTarget } from "./flags.js"

export const RPC_PORT_NAME = "abox.rpc"
export const DEFAULT_VSOCK_PORT = 1024
const VSOCK_HOST_CID = 2

/** the /dev path of the virtio-serial port named `abox.rpc`, if there is one */
export const findVirtioPort = async (sysDir = "/sys/class/virtio-ports"): Promise<string | undefined> => {
  let ports: Array<string>
  try {
    ports = await fsp.readdir(sysDir)
  } catch {
    return undefined
  }
  for (const port of ports) {
    const name = await fsp.readFile(path.join(sysDir, port, "name"), "utf8").catch(() => "")
    if (name.trim() === RPC_PORT_NAME) return `/dev/${port}`
  }
  return undefined
}

const connectUnix = (socketPath: string): Promise<Duplex> =>
  new Promise((resolve, reject) => {
    const socket = net.createConnection(socketPath)
    socket.once("connect", () => {
      socket.off("error", reject)
      resolve(socket)
    })
    socket.once("error", reject)
  })

/**
 * A character device as a Duplex. libuv cannot poll a virtio port as a socket, so reads and
 * writes go through fs streams on one read-write fd (each blocking read holds a thread-pool
 * thread: main.ts raises UV_THREADPOOL_SIZE for that).
 */
const openDevice = async (device: string): Promise<Duplex> => {
  const handle = await fsp.open(device, fs.constants.O_RDWR | fs.constants.O_NOCTTY)
  const fd = handle.fd
  const readable = fs.createReadStream("", { fd, autoClose: false, highWaterMark: 256 * 1024 })
  const writable = fs.createWriteStream("", { fd, autoClose: false })
  const duplex = Duplex.from({ readable, writable })
  duplex.once("close", () => {
    readable.destroy()
    writable.destroy()
    void handle.close().catch(() => undefined)
  })
  return duplex
}

/**
 * socat's notice (at `-d -d`) once its connect succeeded and it moves bytes (socat 1.7.4: `N
 * starting data transfer loop with FDs [0,1] and [5,5]`). socat's start is not the connect: a
 * connect refused (vfkit listens on the vsock port only once the VM is running) ends socat with
 * an `E connect(...)` line and exit 1.
 */
const SOCAT_CONNECTED = "starting data transfer loop"

/** one socat: its stream once connected, or why it ended first; rejects when socat cannot run */
const socatOnce = (port: number): Promise<Duplex | string> =>
  new Promise((resolve, reject) => {
    const child = spawn("socat", ["-d", "-d", "-", `VSOCK-CONNECT:${VSOCK_HOST_CID}:${port}`], {
      stdio: ["pipe", "pipe", "pipe"]
    })
    let connected = false
    let lastError = ""
    let pending = ""
    child.stderr.setEncoding("utf8")
    child.stderr.on("data", (chunk: string) => {
      pending += chunk
      let newline
      while ((newline = pending.indexOf("\n")) !== -1) {
        const line = pending.slice(0, newline)
        pending = pending.slice(newline + 1)
        if (/ [EF] /.test(line)) lastError = line.slice(line.search(/ [EF] /) + 3)
        if (connected) {
          // later warnings and errors of the bridge reach the console, its notices do not
          if (/ [WEF] /.test(line)) process.stderr.write(`socat: ${line}\n`)
        } else if (line.includes(SOCAT_CONNECTED)) {
          connected = true
          const duplex = Duplex.from({ readable: child.stdout, writable: child.stdin })
          duplex.once("close", () => child.kill())
          resolve(duplex)
        }
      }
    })
    child.once("error", (error) =>
      reject(new Error(`vsock:${port} needs socat in the image: ${error.message}`, { cause: error }))
    )
    child.once("exit", (code, signal) => {
      if (!connected) resolve(lastError !== "" ? lastError : `socat exited (${code ?? signal})`)
    })
  })

/**
 * vsock port `port` of the host, through socat, retried with backoff (50 ms doubling to 1 s)
 * until a connect succeeds: vfkit exposes the port only after the VM reaches Running, which the
 * guest's boot can beat. The host bounds the whole wait (its hello timeout) and stops the VM.
 */
export const connectVsock = async (
  port: number,
  log: (line: string) => void = (line) => void process.stderr.write(`abox-guest: ${line}\n`)
): Promise<Duplex> => {
  let delay = 50
  for (let attempt = 1; ; attempt++) {
    const result = await socatOnce(port)
    if (typeof result !== "string") {
      if (attempt > 1) log(`vsock:${port} connected after ${attempt} attempts`)
      return result
    }
    if (attempt === 1 || attempt % 20 === 0) log(`vsock:${port}: ${result}; retrying`)
    await new Promise((resolve) => setTimeout(resolve, delay))
    delay = Math.min(1000, delay * 2)
  }
}

export const openRpc = async (
  target: RpcTarget
): Promise<{ readonly stream: Duplex; readonly describe: string }> => {
  switch (target._tag) {
    case "Unix":
      return { stream: await connectUnix(target.path), describe: `unix:${target.path}` }
    case "Device":
      return { stream: await openDevice(target.path), describe: target.path }
    case "Vsock":
      return { stream: await connectVsock(target.port), describe: `vsock:${target.port}` }
    case "Auto": {
      const device = await findVirtioPort()
      if (device !== undefined) return { stream: await openDevice(device), describe: device }
      return { stream: await connectVsock(DEFAULT_VSOCK_PORT), describe: `vsock:${DEFAULT_VSOCK_PORT}` }
    }
  }
}
