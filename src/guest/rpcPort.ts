/**
 * Opens the guest's end of the host RPC byte stream.
 * - `auto`: the virtio-serial port whose /sys/class/virtio-ports/<port>/name reads `abox.rpc`
 *   (QEMU), else vsock port 1024 (Virtualization.framework).
 * - `unix:PATH`: a unix socket (FakeVmm: the host's rpc.sock).
 * - `/dev/vportNpM`: a virtio-serial port device.
 * - `vsock:PORT`: Node has no AF_VSOCK; the bytes go through `socat` (must be in the image).
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

const connectVsock = (port: number): Promise<Duplex> =>
  new Promise((resolve, reject) => {
    const child = spawn("socat", ["-", `VSOCK-CONNECT:${VSOCK_HOST_CID}:${port}`], {
      stdio: ["pipe", "pipe", "inherit"]
    })
    child.once("error", (error) =>
      reject(new Error(`vsock:${port} needs socat in the image: ${error.message}`))
    )
    child.once("spawn", () => {
      const duplex = Duplex.from({ readable: child.stdout!, writable: child.stdin! })
      duplex.once("close", () => child.kill())
      resolve(duplex)
    })
  })

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
