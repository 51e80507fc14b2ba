#!/usr/bin/env node
// A stand-in for vfkit, for the Darwin backend's tests on any OS, as strict as vfkit v0.6.4 and
// Virtualization.framework are where abox could go wrong. What it holds to, and where vfkit does it
// (github.com/crc-org/vfkit; read, not copied):
// - the command line: the options abox uses, each `--device` split on commas with no escape
//   (pkg/config/virtio.go, deviceFromCmdLine), `--restful-uri unix:///abs` with an empty host
//   (pkg/rest/rest.go, parseRestfulURI);
// - the kernel: on arm64 only an uncompressed `Image` boots, recognised by the "ARMd" magic at
//   0x38, else "kernel must be uncompressed, <path> is a compressed file" (pkg/vf/bootloader.go,
//   isUncompressedArm64Kernel);
// - the disks: each image is opened when the configuration is made, before the VM starts; a qcow2
//   image or a size that is not a multiple of 512 is refused ("The disk image format is not
//   recognized": Virtualization.framework attaches raw images of whole sectors only);
// - diagnostics go to stderr only (logrus; `virtual machine is running` once the VM is), never into
//   the guest console; a configuration error ends vfkit with status 1 (cmd/vfkit/main.go);
// - vsock in listen mode: vfkit waits for the VM to reach Running, then listens on the guest's
//   vsock port, and every guest connection becomes a new connection to the host's socketURL
//   (cmd/vfkit/main.go, runVirtualMachine; pkg/vf/vsock.go, listenVsock); a guest that connects
//   earlier is refused;
// - the RESTful API: GET /vm/state; POST /vm/state Stop (RequestStop) | HardStop answers 202
//   Accepted, a body that is not JSON 400, a state it cannot apply 500 (pkg/rest/rest.go,
//   setVMState; pkg/rest/vf/state_change.go);
// - SIGINT / SIGTERM: request a stop, force it after 5 s (pkg/util/exithandler.go), then exit.
// The "guest" is the real guest agent run on this host with `--rpc auto`, as /sbin/init starts it:
// it finds no virtio-serial port and takes vsock port 1024 through `socat`, here
// test/support/fake-socat/socat, which connects to a private unix socket standing for the vsock
// port (refused before Running, as a vsock port nobody listens on). Its console: the initrd's
// /init is read from the gzipped cpio given as --initrd; under vz the console (hvc0) is the
// virtio_console module, so /init's and the agent's output reach the logFilePath only when /init
// reopens /dev/console after loading its modules; otherwise it is lost, as on a Mac.
// FAKE_VFKIT_MODE=stubborn ignores signals and stop requests (the SIGKILL path).
// FAKE_VFKIT_BOOT_MS (default 1000): how long the VM takes to reach Running once started.
// Every event is appended as a JSON line to <dir of the first disk>/fake-vfkit.log.
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import * as http from "node:http"
import * as net from "node:net"
import * as path from "node:path"
import * as zlib from "node:zlib"
import { fileURLToPath } from "node:url"

const stubborn = process.env.FAKE_VFKIT_MODE === "stubborn"
const bootMs = Number(process.env.FAKE_VFKIT_BOOT_MS ?? "1000")
const here = path.dirname(fileURLToPath(import.meta.url))
const root = path.resolve(here, "..", "..")
const logrus = (level, msg) =>
  process.stderr.write(`time="${new Date().toISOString()}" level=${level} msg=${JSON.stringify(msg)}\n`)
const fail = (message) => {
  logrus("fatal", message)
  process.exit(1)
}

// ---- the command line, checked as vfkit does ----
const argv = process.argv.slice(2)
const opts = { devices: [] }
for (let i = 0; i < argv.length; i++) {
  const flag = argv[i]
  const value = argv[i + 1]
  if (value === undefined) fail(`${flag} needs a value`)
  i++
  switch (flag) {
    case "--cpus":
    case "--memory":
      if (!/^[1-9][0-9]*$/.test(value)) fail(`${flag}: not a number: ${value}`)
      opts[flag.slice(2)] = Number(value)
      break
    case "--kernel":
    case "--initrd":
    case "--kernel-cmdline":
    case "--restful-uri":
      opts[flag.slice(2)] = value
      break
    case "--device":
      opts.devices.push(value)
      break
    default:
      fail(`unknown flag ${flag}`)
  }
}
const options = (text) =>
  Object.fromEntries(
    text
      .split(",")
      .slice(1)
      .map((o) => {
        const at = o.indexOf("=")
        return at === -1 ? [o, true] : [o.slice(0, at), o.slice(at + 1)]
      })
  )
const disks = []
let serial, vsock
for (const device of opts.devices) {
  const kind = device.split(",")[0]
  const o = options(device)
  const allowed = {
    "virtio-blk": ["path", "readonly", "deviceId", "type"],
    "virtio-serial": ["logFilePath", "stdio"],
    "virtio-vsock": ["port", "socketURL", "listen", "connect"],
    "virtio-rng": []
  }[kind]
  if (allowed === undefined) fail(`unknown device type: ${kind}`)
  for (const key of Object.keys(o))
    if (!allowed.includes(key)) fail(`unknown option for ${kind} devices: ${key}`)
  if (kind === "virtio-blk") disks.push({ path: o.path, readonly: o.readonly === true })
  if (kind === "virtio-serial") serial = o.logFilePath
  if (kind === "virtio-vsock")
    vsock = { port: Number(o.port), socketURL: o.socketURL, listen: o.connect !== true }
}
const rest = opts["restful-uri"]
let restPath
if (rest !== undefined && rest !== "none://") {
  const uri = new URL(rest)
  if (uri.protocol !== "unix:") fail(`unsupported restful-uri ${rest}`)
  if (uri.host !== "") fail("invalid unix uri: host is forbidden")
  restPath = decodeURIComponent(uri.pathname)
  if (Buffer.byteLength(restPath) > 103) fail("invalid unix uri: socket path length exceeds macOS limits")
}
if (disks.length < 1) fail("a virtio-blk device is needed")

const sessionDir = path.dirname(disks[0].path)
const logFile = path.join(sessionDir, "fake-vfkit.log")
const record = (event) => fs.appendFileSync(logFile, JSON.stringify({ ...event, pid: process.pid }) + "\n")
record({ event: "argv", argv, stubborn })

// ---- the configuration, as Virtualization.framework checks it before the VM starts ----
const readHead = (file, length) => {
  const fd = fs.openSync(file, "r")
  try {
    const head = Buffer.alloc(length)
    const n = fs.readSync(fd, head, 0, length, 0)
    return head.subarray(0, n)
  } finally {
    fs.closeSync(fd)
  }
}
if (opts.kernel === undefined) fail("missing kernel")
let kernelHead
try {
  kernelHead = readHead(opts.kernel, 2048)
} catch (error) {
  fail(`open ${opts.kernel}: ${error.code === "ENOENT" ? "no such file or directory" : error.message}`)
}
if (kernelHead.subarray(0x38, 0x3c).toString("latin1") !== "ARMd")
  fail(`kernel must be uncompressed, ${opts.kernel} is a compressed file`)
const openDisks = []
for (const disk of disks) {
  let fd
  try {
    fd = fs.openSync(disk.path, disk.readonly ? "r" : "r+")
  } catch (error) {
    fail(`failed to create virtio-blk device ${disk.path}: ${error.message}`)
  }
  const size = fs.fstatSync(fd).size
  const magic = Buffer.alloc(4)
  fs.readSync(fd, magic, 0, 4, 0)
  if (magic.equals(Buffer.from([0x51, 0x46, 0x49, 0xfb])))
    fail(
      `${disk.path}: The disk image format is not recognized. (a qcow2 image: Virtualization.framework attaches raw images only)`
    )
  if (size % 512 !== 0)
    fail(
      `${disk.path}: The disk image format is not recognized. (its size, ${size} bytes, is not a multiple of 512)`
    )
  openDisks.push(fd)
}
record({ event: "disks-opened", disks: disks.map((d) => d.path) })

/** the initrd's /init, from a gzipped newc cpio; undefined when there is none */
const initOf = (file) => {
  try {
    let archive = fs.readFileSync(file)
    if (archive[0] === 0x1f && archive[1] === 0x8b) archive = zlib.gunzipSync(archive)
    let at = 0
    while (at + 110 <= archive.length && archive.toString("latin1", at, at + 6) === "070701") {
      const field = (n) => parseInt(archive.toString("latin1", at + 6 + n * 8, at + 14 + n * 8), 16)
      const size = field(6)
      const nameSize = field(11)
      const name = archive.toString("utf8", at + 110, at + 110 + nameSize - 1)
      const data = at + Math.ceil((110 + nameSize) / 4) * 4
      if (name === "init" || name === "./init") return archive.toString("utf8", data, data + size)
      if (name === "TRAILER!!!") return undefined
      at = data + Math.ceil(size / 4) * 4
    }
  } catch {
    // not an initrd this fake can read: nothing reaches the console
  }
  return undefined
}
/** under vz hvc0 exists only once virtio_console is loaded: /init must reopen the console after */
const reopensConsole = (init) => {
  if (init === undefined) return false
  const lines = init.split("\n")
  const loaded = lines.findLastIndex((line) => /\binsmod\b/.test(line))
  return (
    loaded !== -1 && lines.slice(loaded + 1).some((line) => /^\s*exec\b[^#]*>\s*\/dev\/console/.test(line))
  )
}
const consoleSeen = opts.initrd !== undefined && reopensConsole(initOf(opts.initrd))
record({ event: "console", seen: consoleSeen })
const consoleOut = serial !== undefined && consoleSeen ? fs.openSync(serial, "a", 0o600) : "ignore"
if (serial !== undefined && !consoleSeen) fs.closeSync(fs.openSync(serial, "a", 0o600))

// ---- vsock port 1024 → the host's socketURL (listen mode), only once the VM is Running ----
const guestDir = path.join(sessionDir, "fake-guest")
fs.mkdirSync(guestDir, { recursive: true, mode: 0o700 })
const vsockPath = path.join(guestDir, `vsock-${vsock?.port ?? 0}.sock`)
fs.rmSync(vsockPath, { force: true })
let connections = 0
const vsockServer = net.createServer((guest) => {
  const host = net.createConnection(vsock.socketURL)
  connections += 1
  record({ event: "vsock-connect", port: vsock.port, socketURL: vsock.socketURL, connection: connections })
  guest.pipe(host).pipe(guest)
  const close = () => {
    guest.destroy()
    host.destroy()
  }
  guest.on("error", close)
  host.on("error", close)
  guest.on("close", close)
  host.on("close", close)
})

// ---- the "guest": the real agent, as the image's /sbin/init starts it ----
const bundle = path.join(root, "dist", "abox-guest.js")
const agentArgv = fs.existsSync(bundle)
  ? [bundle]
  : ["--import", "tsx", path.join(root, "src", "guest", "main.ts")]
const configDisk = disks.find((d) => d.readonly)?.path ?? disks[1]?.path
let guest
let state = "VirtualMachineStateStarting"
guest = spawn(
  process.execPath,
  [
    ...agentArgv,
    "--rpc",
    "auto",
    "--config",
    configDisk,
    "--state",
    path.join(guestDir, "state"),
    "--repo",
    path.join(guestDir, "repo"),
    "--on-shutdown",
    "exit",
    ...(process.getuid?.() === 0 ? ["--user", "65534:65534"] : [])
  ],
  {
    cwd: root,
    stdio: ["ignore", consoleOut, consoleOut],
    env: {
      ...process.env,
      PATH: `${path.join(here, "fake-socat")}${path.delimiter}${process.env.PATH ?? "/usr/bin:/bin"}`,
      FAKE_VSOCK_DIR: guestDir
    }
  }
)
guest.on("exit", (code, signal) => {
  // the guest powered off (or was stopped): the VM is stopped, vfkit exits
  state = "VirtualMachineStateStopped"
  record({ event: "guest-exit", code, signal })
  if (stubborn) return
  finish(0)
})
setTimeout(() => {
  if (state !== "VirtualMachineStateStarting") return
  state = "VirtualMachineStateRunning"
  logrus("info", "virtual machine is running")
  record({ event: "running" })
  if (vsock === undefined) return
  if (!vsock.listen)
    return logrus(
      "warning",
      `error exposing vsock port ${vsock.port}: connect mode is not what this fake plays`
    )
  logrus("info", `Exposing vsock port ${vsock.port} on ${vsock.socketURL} (listening)`)
  vsockServer.listen(vsockPath)
}, bootMs)

const finish = (code) => {
  vsockServer.close()
  restServer?.close()
  if (restPath !== undefined) fs.rmSync(restPath, { force: true })
  fs.rmSync(vsockPath, { force: true })
  for (const fd of openDisks) fs.closeSync(fd)
  logrus("info", "VM is stopped")
  record({ event: "exit", code })
  process.exit(code)
}

// RequestStop: our guest has no power-button handling, so "asking" ends the agent with SIGTERM
const requestStop = (why) => {
  record({ event: "stop-request", why })
  if (stubborn || guest === undefined) return
  state = "VirtualMachineStateStopping"
  guest.kill("SIGTERM")
  setTimeout(() => guest.kill("SIGKILL"), 5000).unref()
}
const hardStop = (why) => {
  record({ event: "hard-stop", why })
  if (stubborn || guest === undefined) return
  guest.kill("SIGKILL")
}

// ---- the RESTful API ----
let restServer
if (restPath !== undefined) {
  fs.rmSync(restPath, { force: true })
  restServer = http.createServer((req, res) => {
    let body = ""
    req.on("data", (chunk) => (body += chunk))
    req.on("end", () => {
      record({ event: "rest", method: req.method, url: req.url, body })
      const json = (status, value) => {
        res.writeHead(status, { "content-type": "application/json; charset=utf-8" })
        res.end(JSON.stringify(value))
      }
      if (req.url === "/vm/state" && req.method === "GET") {
        return json(200, {
          state,
          canStart: false,
          canPause: true,
          canResume: false,
          canStop: true,
          canHardStop: true
        })
      }
      if (req.url === "/vm/state" && req.method === "POST") {
        let wanted
        try {
          wanted = JSON.parse(body).state
        } catch (error) {
          return json(400, { error: error.message })
        }
        if (wanted === "Stop") requestStop("rest")
        else if (wanted === "HardStop") hardStop("rest")
        else {
          logrus("error", `failed action ${wanted}: "invalid new VMState: ${wanted}"`)
          return json(500, { error: `invalid new VMState: ${wanted}` })
        }
        res.writeHead(202)
        return res.end()
      }
      json(404, { error: "404 page not found" })
    })
  })
  restServer.listen(restPath)
}

for (const signal of ["SIGINT", "SIGTERM"]) {
  process.on(signal, () => {
    record({ event: "signal", signal })
    requestStop(signal)
  })
}
