#!/usr/bin/env node
// A stand-in for vfkit, for the Darwin backend's tests on any OS. It checks its command line the
// way vfkit does (the options abox uses), records it, and plays the VM:
// - the "guest" is the real guest agent run on this host, over a private unix socket that stands
//   for vsock port 1024; every connection to it is proxied to the host's socketURL, as vfkit's
//   listen mode does (the guest connects out, vfkit dials the host's unix socket);
// - the RESTful API on the --restful-uri unix socket: GET /vm/state, POST /vm/state Stop|HardStop;
// - SIGINT / SIGTERM: request a stop, force it after 5 s (vfkit's exit handler), then exit.
// FAKE_VFKIT_MODE=stubborn ignores signals and stop requests (the SIGKILL path).
// Every event is appended as a JSON line to <dir of the first disk>/fake-vfkit.log.
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import * as http from "node:http"
import * as net from "node:net"
import * as path from "node:path"
import { fileURLToPath } from "node:url"

const stubborn = process.env.FAKE_VFKIT_MODE === "stubborn"
const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..")
const fail = (message) => {
  process.stderr.write(`fake-vfkit: ${message}\n`)
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
if (opts.kernel === undefined || !fs.existsSync(opts.kernel)) fail(`kernel ${opts.kernel} not found`)
if (disks.length < 1 || !disks.every((d) => fs.existsSync(d.path))) fail("a disk image is missing")
const rest = opts["restful-uri"]
let restPath
if (rest !== undefined && rest !== "none://") {
  const uri = new URL(rest)
  if (uri.protocol !== "unix:") fail(`unsupported restful-uri ${rest}`)
  if (uri.host !== "") fail("invalid unix uri: host is forbidden")
  restPath = decodeURIComponent(uri.pathname)
  if (Buffer.byteLength(restPath) > 103) fail("invalid unix uri: socket path length exceeds macOS limits")
}

const sessionDir = path.dirname(disks[0].path)
const logFile = path.join(sessionDir, "fake-vfkit.log")
const record = (event) => fs.appendFileSync(logFile, JSON.stringify({ ...event, pid: process.pid }) + "\n")
record({ event: "argv", argv, stubborn })
const consoleOut = serial !== undefined ? fs.openSync(serial, "w", 0o600) : "ignore"
if (serial !== undefined) fs.writeSync(consoleOut, "fake vfkit: virtual machine is running\n")

// ---- vsock port 1024 → the host's socketURL (listen mode) ----
const guestDir = path.join(sessionDir, "fake-guest")
fs.mkdirSync(guestDir, { recursive: true, mode: 0o700 })
const vsockPath = path.join(guestDir, `vsock-${vsock?.port ?? 0}.sock`)
fs.rmSync(vsockPath, { force: true })
const vsockServer = net.createServer((guest) => {
  if (vsock === undefined || !vsock.listen) return guest.destroy()
  const host = net.createConnection(vsock.socketURL)
  record({ event: "vsock-connect", port: vsock.port, socketURL: vsock.socketURL })
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

// ---- the "guest": the real agent ----
const bundle = path.join(root, "dist", "abox-guest.js")
const agentArgv = fs.existsSync(bundle)
  ? [bundle]
  : ["--import", "tsx", path.join(root, "src", "guest", "main.ts")]
const configDisk = disks.find((d) => d.readonly)?.path ?? disks[1]?.path
let guest
let state = "VirtualMachineStateStarting"
vsockServer.listen(vsockPath, () => {
  guest = spawn(
    process.execPath,
    [
      ...agentArgv,
      "--rpc",
      `unix:${vsockPath}`,
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
    { cwd: root, stdio: ["ignore", consoleOut, consoleOut] }
  )
  state = "VirtualMachineStateRunning"
  guest.on("exit", (code, signal) => {
    // the guest powered off (or was stopped): the VM is stopped, vfkit exits
    state = "VirtualMachineStateStopped"
    record({ event: "guest-exit", code, signal })
    if (stubborn) return
    finish(0)
  })
})

const finish = (code) => {
  vsockServer.close()
  restServer?.close()
  if (restPath !== undefined) fs.rmSync(restPath, { force: true })
  fs.rmSync(vsockPath, { force: true })
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
      if (req.url === "/vm/state" && req.method === "GET") {
        res.writeHead(200, { "content-type": "application/json" })
        return res.end(
          JSON.stringify({
            state,
            canStart: false,
            canPause: true,
            canResume: false,
            canStop: true,
            canHardStop: true
          })
        )
      }
      if (req.url === "/vm/state" && req.method === "POST") {
        let wanted
        try {
          wanted = JSON.parse(body).state
        } catch {
          wanted = undefined
        }
        if (wanted === "Stop") requestStop("rest")
        else if (wanted === "HardStop") hardStop("rest")
        else {
          res.writeHead(400)
          return res.end(`invalid new VMState: ${wanted}`)
        }
        res.writeHead(200)
        return res.end()
      }
      res.writeHead(404)
      res.end()
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
