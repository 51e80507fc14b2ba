/**
 * The Darwin backend ("vz": vfkit behind abox-vmm), tested on any OS against a fake vfkit
 * (test/support/fake-vfkit.mjs) that checks its command line like vfkit, proxies "vsock" port
 * 1024 to the host's rpc.sock, runs the real guest agent, serves vfkit's REST stop and honours
 * SIGINT; its stubborn twin ignores all of that (the SIGKILL path). Plus the pure parts: argv,
 * socket paths, kernel decompression, the REST client.
 */
import * as fs from "node:fs"
import * as http from "node:http"
import * as os from "node:os"
import * as path from "node:path"
import * as zlib from "node:zlib"
import { describe, expect, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import * as fc from "fast-check"
import { DarwinVmmLive } from "../src/layers/DarwinVmm.js"
import { fallbackSignalFor } from "../src/vmm/supervisor.js"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { chooseBackend } from "../src/lib/env.js"
import {
  ensureSocketDir,
  maxSocketPathBytes,
  rpcSocketPath,
  shortSocketDir,
  vfkitSocketPath
} from "../src/lib/socketPath.js"
import { encodeConfigDisk } from "../src/protocol/ConfigDisk.js"
import { GuestRpc } from "../src/services/GuestRpc.js"
import { type CloseBounds, type VmSpec } from "../src/domain/vm.js"
import { VmmBackend } from "../src/services/VmmBackend.js"
import { buildVfkitArgv, uncompressedKernel, vfkitGetState, vfkitSetState } from "../src/vmm/vfkit.js"
import { earlyExitReport } from "../src/vmm/console.js"
import { cloneDisk } from "../src/lib/disk.js"
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { alive } from "./support/processes.js"

const root = path.resolve(__dirname, "..")
const fakeVfkit = path.join(root, "test", "support", "fake-vfkit.mjs")
const stubbornVfkit = path.join(root, "test", "support", "fake-vfkit-stubborn")
const helperFromSource = [process.execPath, "--import", "tsx", path.join(root, "src", "vmm", "helper.ts")]

const argvInput = {
  kernel: "/img/Image",
  initrd: "/img/initrd.gz",
  rootDisk: "/s/root.raw",
  configDisk: "/s/config.raw",
  rpcSocket: "/s/rpc.sock",
  restSocket: "/s/vfkit.sock",
  consoleLog: "/s/console.log",
  cpus: 2,
  memoryMiB: 1024
}

describe("vfkit command line", () => {
  it("boots the kernel directly with rw root, read-only config, serial log, vsock listen and REST", () => {
    const argv = Either.getOrThrow(buildVfkitArgv({ ...argvInput, kernelArgs: ["abox.test=1"] }))
    expect(argv).toEqual([
      "--cpus",
      "2",
      "--memory",
      "1024",
      "--kernel",
      "/img/Image",
      "--initrd",
      "/img/initrd.gz",
      "--kernel-cmdline",
      "console=hvc0 quiet panic=-1 abox.test=1",
      "--device",
      "virtio-blk,path=/s/root.raw",
      "--device",
      "virtio-blk,path=/s/config.raw,readonly",
      "--device",
      "virtio-serial,logFilePath=/s/console.log",
      "--device",
      "virtio-rng",
      "--device",
      "virtio-vsock,port=1024,socketURL=/s/rpc.sock,listen",
      "--restful-uri",
      "unix:///s/vfkit.sock"
    ])
    // no network device of any kind
    expect(argv.join(" ")).not.toMatch(/virtio-net|nat/)
  })

  it("refuses paths vfkit would misread (commas split its options; URLs), and relative paths", () => {
    const refused = (override: Partial<typeof argvInput>) =>
      Either.match(buildVfkitArgv({ ...argvInput, ...override }), {
        onLeft: (e) => e.reason,
        onRight: () => "ok"
      })
    expect(refused({ rootDisk: "/s,evil/root.raw" })).toMatch(/comma/)
    expect(refused({ rpcSocket: "/s/rpc%2f.sock" })).toMatch(/socket URL/)
    expect(refused({ kernel: "Image" })).toMatch(/absolute/)
    expect(refused({ rootDisk: "/Users/me/Library/Application Support/ABox/sessions/x/root.raw" })).toBe("ok")
  })

  it("the fallback signal is SIGINT on macOS, SIGTERM elsewhere", () => {
    expect(fallbackSignalFor("darwin")).toBe("SIGINT")
    expect(fallbackSignalFor("linux")).toBe("SIGTERM")
  })

  it("the lifecycle picks vz on macOS, QEMU elsewhere, unless ABOX_VMM says otherwise", () => {
    expect(chooseBackend(Option.none(), "darwin")).toBe("vz")
    expect(chooseBackend(Option.none(), "linux")).toBe("qemu")
    expect(chooseBackend(Option.some("qemu"), "darwin")).toBe("qemu")
    expect(chooseBackend(Option.some("vz"), "linux")).toBe("vz")
    expect(chooseBackend(Option.some("fake"), "darwin")).toBe("fake")
  })
})

describe("socket paths (104-byte sun_path on macOS)", () => {
  it("keeps the session directory when the path fits, else a short hashed path under /tmp/abox-<uid>", () => {
    expect(rpcSocketPath("/Users/me/.abox/sessions/abc", "darwin")).toBe(
      "/Users/me/.abox/sessions/abc/rpc.sock"
    )
    const long =
      "/Users/someone-with-a-long-name/Library/Application Support/ABox/sessions/0123456789abcdef0123456789"
    const short = rpcSocketPath(long, "darwin", 501)
    expect(short).toMatch(/^\/tmp\/abox-501\/[0-9a-f]{16}-rpc\.sock$/)
    expect(vfkitSocketPath(long, "darwin", 501)).toBe(short.replace("rpc.sock", "vfkit.sock"))
    // Linux allows 108 bytes: a path of 105 bytes stays in place there, not on macOS
    const mid = "/h/" + "x".repeat(105 - "/h//rpc.sock".length)
    expect(Buffer.byteLength(path.join(mid, "rpc.sock"))).toBe(105)
    expect(rpcSocketPath(mid, "linux")).toBe(path.join(mid, "rpc.sock"))
    expect(rpcSocketPath(mid, "darwin", 501).startsWith("/tmp/abox-501/")).toBe(true)
  })

  it("property: always within the limit, stable, distinct for distinct sessions", () => {
    fc.assert(
      fc.property(
        fc.array(fc.stringMatching(/^[A-Za-z0-9 ._-]{1,40}$/), { minLength: 1, maxLength: 8 }),
        fc.array(fc.stringMatching(/^[A-Za-z0-9 ._-]{1,40}$/), { minLength: 1, maxLength: 8 }),
        fc.constantFrom<NodeJS.Platform>("darwin", "linux"),
        (a, b, platform) => {
          const dirA = "/" + a.join("/")
          const dirB = "/" + b.join("/")
          const pa = rpcSocketPath(dirA, platform, 501)
          expect(Buffer.byteLength(pa)).toBeLessThanOrEqual(maxSocketPathBytes(platform))
          expect(rpcSocketPath(dirA, platform, 501)).toBe(pa)
          if (path.resolve(dirA) !== path.resolve(dirB))
            expect(rpcSocketPath(dirB, platform, 501)).not.toBe(pa)
        }
      )
    )
  })

  it.effect("the short directory is created 0700 and a foreign-owned one is refused", () =>
    Effect.gen(function* () {
      const uid = process.getuid?.() ?? 0
      const socket = path.join(shortSocketDir(uid), "0000000000000000-rpc.sock")
      yield* ensureSocketDir(socket, uid)
      const stat = fs.lstatSync(shortSocketDir(uid))
      expect(stat.isDirectory() && (stat.mode & 0o777) === 0o700 && stat.uid === uid).toBe(true)
      // a /tmp/abox-<uid> that someone else made (here: us, for a uid that is not ours) is refused
      const foreign = uid + 4242
      fs.rmSync(shortSocketDir(foreign), { recursive: true, force: true })
      fs.mkdirSync(shortSocketDir(foreign), { mode: 0o700 })
      const refused = yield* Effect.flip(
        ensureSocketDir(path.join(shortSocketDir(foreign), "x.sock"), foreign)
      )
      expect(refused.reason).toMatch(/owned by uid/)
      // and so is a symlink planted in its place
      fs.rmSync(shortSocketDir(foreign), { recursive: true, force: true })
      fs.symlinkSync(os.tmpdir(), shortSocketDir(foreign))
      const planted = yield* Effect.flip(
        ensureSocketDir(path.join(shortSocketDir(foreign), "x.sock"), foreign)
      )
      expect(planted.reason).toMatch(/not a directory/)
      fs.rmSync(shortSocketDir(foreign), { force: true })
    })
  )
})

describe("kernel and REST client", () => {
  it.effect("a gzipped kernel is decompressed once beside it; an uncompressed one is used as is", () =>
    Effect.gen(function* () {
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-kernel-"))
      const image = Buffer.from("ARM64 Image " + "k".repeat(5000))
      fs.writeFileSync(path.join(dir, "vmlinuz"), zlib.gzipSync(image))
      const out = yield* uncompressedKernel(path.join(dir, "vmlinuz"), dir)
      expect(out).toBe(path.join(dir, "vmlinuz.Image"))
      expect(fs.readFileSync(out).equals(image)).toBe(true)
      const mtime = fs.statSync(out).mtimeMs
      expect(yield* uncompressedKernel(path.join(dir, "vmlinuz"), dir)).toBe(out)
      expect(fs.statSync(out).mtimeMs).toBe(mtime)
      fs.writeFileSync(path.join(dir, "Image"), image)
      expect(yield* uncompressedKernel(path.join(dir, "Image"), dir)).toBe(path.join(dir, "Image"))
      const missing = yield* Effect.flip(uncompressedKernel(path.join(dir, "nope"), dir))
      expect(missing._tag).toBe("KernelError")
    })
  )

  it.live("GET /vm/state is decoded; POST sends the state; a bad answer is a typed error", () =>
    Effect.gen(function* () {
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-rest-"))
      const socket = path.join(dir, "vfkit.sock")
      const posted: Array<string> = []
      let answer = JSON.stringify({ state: "VirtualMachineStateRunning", canStop: true })
      const server = http.createServer((req, res) => {
        let body = ""
        req.on("data", (chunk: string) => (body += chunk))
        req.on("end", () => {
          if (req.method === "POST") posted.push(body)
          res.writeHead(req.method === "POST" && body.includes("Bogus") ? 400 : 200)
          res.end(req.method === "GET" ? answer : "")
        })
      })
      yield* Effect.acquireRelease(
        Effect.async<void>((resume) => void server.listen(socket, () => resume(Effect.void))),
        () => Effect.sync(() => server.close())
      )
      expect(yield* vfkitGetState(socket)).toEqual({ state: "VirtualMachineStateRunning", canStop: true })
      yield* vfkitSetState(socket, "Stop")
      expect(posted).toEqual(['{"state":"Stop"}'])
      answer = "{not json"
      expect((yield* Effect.flip(vfkitGetState(socket)))._tag).toBe("VfkitRestError")
      const gone = yield* Effect.flip(vfkitSetState(path.join(dir, "absent.sock"), "Stop"))
      expect(gone.reason).toMatch(/ENOENT|ECONNREFUSED/)
    }).pipe(Effect.scoped)
  )
})

// ---- the layer, end to end against the fake vfkit ----

/** an arm64 `Image` as vfkit recognises one: "ARMd" at 0x38 (pkg/vf/bootloader.go) */
const fakeArm64Image = (): Buffer => {
  const image = Buffer.alloc(4096, 0)
  image.write("ARMd", 0x38, "latin1")
  image.write("fake arm64 Image", 0x100, "latin1")
  return image
}

/** a gzipped newc cpio holding `files` (what an initrd is) */
export const newcCpio = (files: Record<string, string>): Buffer => {
  const parts: Array<Buffer> = []
  const pad = (n: number) => Buffer.alloc((4 - (n % 4)) % 4)
  let ino = 1
  const entry = (name: string, data: Buffer, mode: number) => {
    const nameBytes = Buffer.from(name + "\0")
    const hex = (n: number) => n.toString(16).padStart(8, "0")
    const header =
      "070701" + [ino++, mode, 0, 0, 1, 0, data.length, 0, 0, 0, 0, nameBytes.length, 0].map(hex).join("")
    parts.push(Buffer.from(header, "latin1"), nameBytes, pad(110 + nameBytes.length), data, pad(data.length))
  }
  for (const [name, text] of Object.entries(files)) entry(name, Buffer.from(text), 0o100755)
  entry("TRAILER!!!", Buffer.alloc(0), 0)
  return zlib.gzipSync(Buffer.concat(parts))
}

/** the images' initrd /init (images/initrd-init.sh, modules as build-small.sh fills them in) */
const initrdInit = fs
  .readFileSync(path.join(root, "images", "initrd-init.sh"), "utf8")
  .replace("@MODULES@", "virtio_ring virtio virtio_pci virtio_blk virtio_console virtio-rng vsock")

const newSpec = (
  config: { readonly ignoreShutdown?: boolean } = {},
  bounds?: CloseBounds,
  longDir = false,
  init: string = initrdInit
): VmSpec => {
  let sessionDir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-vz-"))
  if (longDir) {
    sessionDir = path.join(sessionDir, "Library", "Application Support", "ABox", "sessions", "x".repeat(64))
    fs.mkdirSync(sessionDir, { recursive: true, mode: 0o700 })
  }
  fs.writeFileSync(
    path.join(sessionDir, "config.raw"),
    encodeConfigDisk({ format: 1, sessionId: "vz", model: "m", ...config })
  )
  fs.writeFileSync(path.join(sessionDir, "root.raw"), "")
  fs.truncateSync(path.join(sessionDir, "root.raw"), 1024 * 1024)
  // an older image: only the gzipped kernel (the backend decompresses it for vfkit)
  fs.writeFileSync(path.join(sessionDir, "vmlinuz"), zlib.gzipSync(fakeArm64Image()))
  fs.writeFileSync(path.join(sessionDir, "initrd.gz"), newcCpio({ init }))
  return {
    sessionId: path.basename(sessionDir),
    sessionDir,
    arch: "aarch64",
    kernel: path.join(sessionDir, "vmlinuz"),
    initrd: path.join(sessionDir, "initrd.gz"),
    rootDisk: path.join(sessionDir, "root.raw"),
    configDisk: path.join(sessionDir, "config.raw"),
    rpcSocket: rpcSocketPath(sessionDir, "darwin"),
    consoleLog: path.join(sessionDir, "console.log"),
    cpus: 2,
    memoryMiB: 1024,
    lockFd: -1,
    bounds: bounds ?? { graceful: "10 seconds", signalled: "5 seconds", killed: "5 seconds" }
  }
}

type FakeEvent = { readonly event: string; readonly [key: string]: unknown }
const fakeLog = (spec: VmSpec): Array<FakeEvent> =>
  fs
    .readFileSync(path.join(spec.sessionDir, "fake-vfkit.log"), "utf8")
    .split("\n")
    .filter((line) => line !== "")
    .map((line) => JSON.parse(line) as FakeEvent)

const rpcOptions = { helloTimeout: "30 seconds", shutdownTimeout: "3 seconds" } as const
const live = (vfkit: string, stepMs?: number) =>
  Layer.mergeAll(
    GuestRpcLive,
    DarwinVmmLive({
      platform: "darwin",
      arch: "aarch64",
      vfkit,
      helper: helperFromSource,
      ...(stepMs === undefined ? {} : { stepMs })
    })
  )

/** open a session VM on the fake vfkit, run one turn, close; returns the handle */
const openTurnClose = (spec: VmSpec) =>
  Effect.gen(function* () {
    const rpc = yield* GuestRpc
    const vmm = yield* VmmBackend
    return yield* Effect.scoped(
      Effect.gen(function* () {
        // what the lifecycle does before listening: the short socket directory, when used
        yield* ensureSocketDir(spec.rpcSocket)
        const listener = yield* rpc.listen(spec.rpcSocket, rpcOptions)
        const handle = yield* vmm.start(spec)
        const conn = yield* listener.accept
        expect(conn.hello.protocol).toBe(4)
        const events = yield* Stream.runCollect(conn.turn("echo hello from vz"))
        const stdout = Chunk.toReadonlyArray(events)
          .map((e) => (e._tag === "Event" && e.event.kind === "stdout" ? e.event.data : ""))
          .join("")
        expect(stdout).toBe("hello from vz\n")
        return handle
      })
    )
  })

describe("DarwinVmm (vz) against a fake vfkit", () => {
  it.live(
    "boot → hello over the vsock proxy → turn → shutdown RPC → graceful; argv as vfkit reads it",
    () =>
      Effect.gen(function* () {
        const spec = newSpec()
        const handle = yield* openTurnClose(spec)
        expect(handle.backend).toBe("vz")
        const outcome = yield* handle.outcome
        expect(outcome).toMatchObject({ how: "graceful", exitCode: 0, signal: null })
        const log = fakeLog(spec)
        const argv = log.find((e) => e.event === "argv")!.argv as Array<string>
        expect(argv).toContain(`virtio-blk,path=${spec.configDisk},readonly`)
        expect(argv).toContain(`virtio-vsock,port=1024,socketURL=${spec.rpcSocket},listen`)
        expect(argv).toContain(`unix://${path.join(spec.sessionDir, "vfkit.sock")}`)
        // the gzipped kernel was handed over decompressed
        expect(argv[argv.indexOf("--kernel") + 1]).toBe(`${spec.kernel}.Image`)
        const events = log.map((e) => e.event)
        // vsock only once Running; the guest's connect before it was refused and retried
        expect(events.indexOf("running")).toBeGreaterThan(-1)
        expect(events.indexOf("vsock-connect")).toBeGreaterThan(events.indexOf("running"))
        expect(events).not.toContain("signal")
        expect(alive(handle.vmmPid) || alive(handle.helperPid)).toBe(false)
        // the guest's console: the agent's own lines, since /init reopened the console after
        // loading virtio_console; vfkit's diagnostics are in vfkit.log, never in the console
        const consoleText = fs.readFileSync(spec.consoleLog, "utf8")
        expect(consoleText).toMatch(/abox-guest: vsock:1024: .*retrying/)
        expect(consoleText).toMatch(/abox-guest: vsock:1024 connected after \d+ attempts/)
        expect(consoleText).not.toContain("virtual machine is running")
        expect(fs.readFileSync(path.join(spec.sessionDir, "vfkit.log"), "utf8")).toContain(
          "virtual machine is running"
        )
      }).pipe(Effect.provide(live(fakeVfkit))),
    60_000
  )

  it.live(
    "a session directory too long for a socket: rpc.sock and vfkit.sock move to /tmp/abox-<uid>",
    () =>
      Effect.gen(function* () {
        const spec = newSpec({}, undefined, true)
        expect(Buffer.byteLength(path.join(spec.sessionDir, "rpc.sock"))).toBeGreaterThan(103)
        expect(path.dirname(spec.rpcSocket)).toBe(shortSocketDir())
        const handle = yield* openTurnClose(spec)
        expect(yield* handle.outcome).toMatchObject({ how: "graceful" })
        const argv = fakeLog(spec).find((e) => e.event === "argv")!.argv as Array<string>
        const rest = argv[argv.indexOf("--restful-uri") + 1]!
        expect(rest).toBe(`unix://${vfkitSocketPath(spec.sessionDir, "darwin")}`)
        expect(rest.startsWith(`unix://${shortSocketDir()}/`)).toBe(true)
        // the REST socket is gone once the VM is
        expect(fs.existsSync(rest.slice("unix://".length))).toBe(false)
      }).pipe(Effect.provide(live(fakeVfkit))),
    60_000
  )

  it.live(
    "a guest that ignores shutdown: SIGINT to the helper → REST Stop ends the VM (signalled)",
    () =>
      Effect.gen(function* () {
        const spec = newSpec(
          { ignoreShutdown: true },
          { graceful: "500 millis", signalled: "8 seconds", killed: "5 seconds" }
        )
        const handle = yield* openTurnClose(spec)
        const outcome = yield* handle.outcome
        expect(outcome.how).toBe("signalled")
        const log = fakeLog(spec)
        const rest = log.filter((e) => e.event === "rest").map((e) => e.body)
        expect(rest[0]).toBe('{"state":"Stop"}')
        expect(log.find((e) => e.event === "stop-request")).toMatchObject({ why: "rest" })
        // the REST stop was enough: vfkit itself was never signalled
        expect(log.map((e) => e.event)).not.toContain("signal")
        expect(log.at(-1)).toMatchObject({ event: "exit", code: 0 })
        expect(alive(handle.vmmPid) || alive(handle.helperPid)).toBe(false)
      }).pipe(Effect.provide(live(fakeVfkit, 1000))),
    60_000
  )

  it.live(
    "a vfkit that ignores REST and signals: the helper's steps are bounded, SIGKILL ends both, reaped",
    () =>
      Effect.gen(function* () {
        const spec = newSpec({}, { graceful: "300 millis", signalled: "1500 millis", killed: "5 seconds" })
        const handle = yield* openTurnClose(spec)
        const outcome = yield* handle.outcome
        expect(outcome).toMatchObject({ how: "killed", signal: "SIGKILL", exitCode: null })
        const events = fakeLog(spec).map((e) => e.event)
        // the helper asked (REST Stop) before the supervisor's bound ran out
        expect(events).toContain("rest")
        expect(events).not.toContain("exit")
        expect(alive(handle.vmmPid)).toBe(false)
        expect(alive(handle.helperPid)).toBe(false)
      }).pipe(Effect.provide(live(stubbornVfkit, 5000))),
    60_000
  )

  it.live(
    "the helper's own chain: REST Stop, HardStop ignored → SIGINT to vfkit → SIGKILL, within the signalled bound",
    () =>
      Effect.gen(function* () {
        const spec = newSpec({}, { graceful: "300 millis", signalled: "10 seconds", killed: "5 seconds" })
        const handle = yield* openTurnClose(spec)
        const outcome = yield* handle.outcome
        expect(outcome).toMatchObject({ how: "signalled", signal: "SIGKILL" })
        const log = fakeLog(spec)
        expect(log.filter((e) => e.event === "rest").map((e) => e.body)).toEqual([
          '{"state":"Stop"}',
          '{"state":"HardStop"}'
        ])
        expect(log.find((e) => e.event === "signal")).toMatchObject({ signal: "SIGINT" })
        expect(alive(handle.vmmPid) || alive(handle.helperPid)).toBe(false)
      }).pipe(Effect.provide(live(stubbornVfkit, 300))),
    60_000
  )

  it.live(
    "what vfkit refuses (a disk size not a multiple of 512, a qcow2 disk, a kernel that is no arm64 Image) ends the VM with vfkit's own reason in the report",
    () =>
      Effect.gen(function* () {
        const vmm = yield* VmmBackend
        const refused = (spoil: (spec: VmSpec) => VmSpec | void) =>
          Effect.scoped(
            Effect.gen(function* () {
              const base = newSpec()
              const spec = spoil(base) ?? base
              const handle = yield* vmm.start(spec)
              const exit = yield* handle.exited
              expect(exit.exitCode).toBe(1)
              expect(handle.vmmLog).toBe(path.join(spec.sessionDir, "vfkit.log"))
              return earlyExitReport(spec.consoleLog, handle.vmmLog, (line) => line)
            })
          )
        const odd = yield* refused((spec) => fs.truncateSync(spec.rootDisk, 4 * 1024 * 1024 + 4))
        expect(odd).toMatch(
          /vfkit\.log ended: .*root\.raw: The disk image format is not recognized.*not a multiple of 512/
        )
        const qcow2 = yield* refused((spec) => {
          const fd = fs.openSync(spec.rootDisk, "r+")
          fs.writeSync(fd, Buffer.from([0x51, 0x46, 0x49, 0xfb]), 0, 4, 0)
          fs.closeSync(fd)
        })
        expect(qcow2).toMatch(/qcow2 image/)
        const kernel = yield* refused((spec) => {
          // not gzip, so handed over as it is; a zboot or otherwise compressed kernel, no Image
          fs.writeFileSync(spec.kernel, Buffer.alloc(4096, 7))
        })
        expect(kernel).toMatch(/kernel must be uncompressed, .*vmlinuz is a compressed file/)
      }).pipe(
        Effect.provide(
          DarwinVmmLive({ platform: "darwin", arch: "aarch64", vfkit: fakeVfkit, helper: helperFromSource })
        )
      ),
    60_000
  )

  it.live(
    "a root disk cloned from a golden of an odd size boots (the clone is a whole MiB; vfkit refuses the odd size)",
    () =>
      Effect.gen(function* () {
        const spec = newSpec()
        const golden = path.join(spec.sessionDir, "golden.raw")
        fs.writeFileSync(golden, "")
        fs.truncateSync(golden, 8 * 1024 * 1024 + 1000)
        fs.rmSync(spec.rootDisk)
        yield* cloneDisk(golden, spec.rootDisk).pipe(
          Effect.provide(NodeCommandExecutor.layer.pipe(Layer.provide(NodeFileSystem.layer)))
        )
        const handle = yield* openTurnClose(spec)
        expect(yield* handle.outcome).toMatchObject({ how: "graceful" })
        expect(fakeLog(spec).find((e) => e.event === "disks-opened")).toBeDefined()
      }).pipe(Effect.provide(live(fakeVfkit))),
    60_000
  )

  it.live(
    "an initrd whose /init does not reopen the console after its modules: the guest's output is lost",
    () =>
      Effect.gen(function* () {
        // the images' /init before the console was reopened (what a Mac's console.log showed: nothing)
        const old = initrdInit.replace(/\nif \{ : >\/dev\/console; \} 2>\/dev\/null; then\n[^]*?\nfi\n/, "\n")
        expect(old).not.toContain("console ready")
        const spec = newSpec({}, undefined, false, old)
        const handle = yield* openTurnClose(spec)
        expect(yield* handle.outcome).toMatchObject({ how: "graceful" })
        expect(fakeLog(spec).find((e) => e.event === "console")).toMatchObject({ seen: false })
        expect(fs.readFileSync(spec.consoleLog, "utf8")).not.toContain("abox-guest")
      }).pipe(Effect.provide(live(fakeVfkit))),
    60_000
  )

  it.effect("typed failures before anything starts: no vfkit, wrong arch, over-long socket path", () =>
    Effect.gen(function* () {
      const vmm = yield* VmmBackend
      const missing = yield* Effect.flip(
        Effect.scoped(
          Effect.flatMap(
            Effect.provide(VmmBackend, DarwinVmmLive({ platform: "darwin", vfkit: "/nonexistent/vfkit" })),
            (other) => other.start(newSpec())
          )
        )
      )
      expect(missing._tag).toBe("VmmUnavailable")
      const wrongArch = yield* Effect.flip(Effect.scoped(vmm.start({ ...newSpec(), arch: "x86_64" })))
      expect(wrongArch).toMatchObject({ _tag: "VmmError", reason: "arch" })
      const spec = newSpec()
      const tooLong = yield* Effect.flip(
        Effect.scoped(
          vmm.start({ ...spec, rpcSocket: path.join(spec.sessionDir, "x".repeat(120), "rpc.sock") })
        )
      )
      expect(tooLong).toMatchObject({ _tag: "VmmError", reason: "socket_path" })
    }).pipe(
      Effect.provide(
        DarwinVmmLive({ platform: "darwin", arch: "aarch64", vfkit: fakeVfkit, helper: helperFromSource })
      )
    )
  )
})
