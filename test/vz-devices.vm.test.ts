/**
 * The test image's kernel and initrd with the devices vfkit gives a guest, under QEMU: the
 * console is `hvc0` on a virtio console (vfkit's `virtio-serial,logFilePath=`; in Debian's cloud
 * kernels virtio_console is a module, so there is no console when /init starts) and an entropy
 * device (`virtio-rng`). The RPC channel stays QEMU's virtio-serial port (this host has no
 * /dev/vhost-vsock). Checks that what /init and the agent write reaches the console file, and
 * that the kernel takes its randomness from the virtio-rng device.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { cloneDisk, writeConfigDisk } from "../src/lib/disk.js"
import { GuestRpc } from "../src/services/GuestRpc.js"
import { buildQemuArgv } from "../src/vmm/argv.js"
import { ensureTestImage, runTurn, vmLayer, vmSkipReason } from "./e2e-vm-image.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`vz-devices: skipped: ${skip}`)

/** QEMU's session command line with vfkit's console and entropy device in place of the serial port */
const vzLikeArgv = (argv: ReadonlyArray<string>, consoleLog: string): Array<string> => {
  const out: Array<string> = []
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!
    // the serial console (`-chardev stdio,id=con` and `-serial chardev:con`) goes
    if (arg === "-chardev" && argv[i + 1]!.startsWith("stdio,")) {
      i++
      continue
    }
    if (arg === "-serial") {
      i++
      continue
    }
    if (arg === "-append") {
      out.push(arg, argv[++i]!.replace("console=ttyS0", "console=hvc0"))
      continue
    }
    out.push(arg)
    if (arg === "-device" && argv[i + 1] === "virtio-serial-pci") {
      out.push(
        argv[++i]!,
        "-chardev",
        `file,id=con,path=${consoleLog}`,
        "-device",
        "virtconsole,chardev=con,nr=0"
      )
    }
  }
  return [...out, "-device", "virtio-rng-pci"]
}

describe.skipIf(skip !== undefined)("vfkit's devices under QEMU (real kernel, real initrd)", () => {
  it.live(
    "console on hvc0 (a module): /init's and the agent's lines reach the console; the kernel's rng is virtio_rng",
    () =>
      Effect.gen(function* () {
        const image = yield* Effect.promise(() => ensureTestImage())
        const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-vzdev-"))
        yield* cloneDisk(image.rootDisk, path.join(dir, "root.raw"))
        yield* writeConfigDisk(path.join(dir, "config.raw"), { format: 1, sessionId: "vzdev", model: "test" })
        const consoleLog = path.join(dir, "console.log")
        const rpcSocket = path.join(dir, "rpc.sock")
        const rpc = yield* GuestRpc
        const listener = yield* rpc.listen(rpcSocket, {
          helloTimeout: "90 seconds",
          shutdownTimeout: "15 seconds"
        })
        const argv = vzLikeArgv(
          buildQemuArgv({
            arch: "x86_64",
            accel: "tcg",
            kernel: image.kernel,
            initrd: image.initrd,
            rootDisk: path.join(dir, "root.raw"),
            configDisk: path.join(dir, "config.raw"),
            rpcSocket,
            qmpSocket: path.join(dir, "qmp.sock"),
            cpus: 2,
            memoryMiB: 1024
          }),
          consoleLog
        )
        const qemu = yield* Effect.acquireRelease(
          Effect.sync(() => spawn("qemu-system-x86_64", argv, { stdio: ["ignore", "ignore", "pipe"] })),
          (child) =>
            Effect.async<void>((resume) => {
              if (child.exitCode !== null || child.signalCode !== null) return resume(Effect.void)
              child.once("exit", () => resume(Effect.void))
              child.kill("SIGKILL")
            })
        )
        let qemuErr = ""
        qemu.stderr.on("data", (chunk: Buffer) => (qemuErr += chunk.toString()))
        const connection = yield* Effect.scoped(
          Effect.gen(function* () {
            const conn = yield* listener.accept.pipe(
              Effect.tapError(() => Effect.sync(() => console.error(qemuErr)))
            )
            const rng = yield* runTurn(conn, "cat /sys/class/misc/hw_random/rng_current")
            expect(rng.trim()).toBe("virtio_rng.0")
            return conn.hello
          })
        )
        expect(connection.protocol).toBe(4)
        const text = fs.readFileSync(consoleLog, "utf8")
        // /init's own line once it reopened the console, then what the root's init and the agent say
        expect(text).toContain("abox-initrd: console ready")
        expect(text).toMatch(/abox-guest/)
      }).pipe(Effect.scoped, Effect.provide(vmLayer)),
    240_000
  )
})
