import { describe, expect, it } from "@effect/vitest"
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Scope from "effect/Scope"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { makeQemuVmm } from "../src/layers/QemuVmm.js"
import { cloneDisk } from "../src/lib/disk.js"
import type { VmSpec } from "../src/domain/vm.js"
import { bootSession, ensureTestImage, processesMentioning, vmLayer, vmSkipReason } from "./e2e-vm-image.js"
import { alive } from "./support/processes.js"

/** QemuVmm's processes (the KVM probe) run through Command */
const Executor = NodeCommandExecutor.layer.pipe(Layer.provide(NodeFileSystem.layer))

const skip = vmSkipReason()
const hasQemu =
  fs.existsSync("/usr/bin/qemu-system-x86_64") || fs.existsSync("/usr/local/bin/qemu-system-x86_64")

/**
 * A stand-in helper: reports a child `sleep` as its VMM, and either honours SIGTERM (exits,
 * killing the sleep) or ignores it, so that each bounded step of Close can be driven for real
 * in well under a second.
 */
const fakeHelper = (dir: string, onTerm: "exit" | "ignore"): string => {
  const file = path.join(dir, `fake-helper-${onTerm}.cjs`)
  fs.writeFileSync(
    file,
    `const { spawn } = require("node:child_process")
process.stdin.resume(); process.stdin.on("data", () => {})
const vmm = spawn("sleep", ["300"], { stdio: "ignore" })
process.stdout.write(JSON.stringify({ event: "started", pid: vmm.pid }) + "\\n")
process.on("SIGTERM", () => {
  ${onTerm === "exit" ? `vmm.kill("SIGKILL"); vmm.on("exit", (c, s) => { process.stdout.write(JSON.stringify({ event: "exited", code: c, signal: s }) + "\\n"); process.exit(0) })` : ""}
})
setInterval(() => {}, 1 << 30)
`
  )
  return file
}

const fakeSpec = (dir: string): VmSpec => ({
  sessionId: path.basename(dir),
  sessionDir: dir,
  arch: "x86_64",
  kernel: "/nonexistent",
  initrd: "/nonexistent",
  rootDisk: path.join(dir, "root.raw"),
  configDisk: path.join(dir, "config.raw"),
  rpcSocket: path.join(dir, "rpc.sock"),
  consoleLog: path.join(dir, "console.log"),
  cpus: 1,
  memoryMiB: 128,
  lockFd: -1,
  bounds: { graceful: "300 millis", signalled: "300 millis", killed: "3 seconds" }
})

describe.skipIf(!hasQemu)("Close: the bounded path with stand-in helpers (real processes)", () => {
  it.live("a helper that honours SIGTERM ends as signalled; nothing is left", () =>
    Effect.gen(function* () {
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-close-"))
      fs.writeFileSync(path.join(dir, "console.log"), "boot line\nlast words\n")
      const vmm = yield* makeQemuVmm({
        accel: "tcg",
        helper: [process.execPath, fakeHelper(dir, "exit")],
        note: () => undefined
      })
      const scope = yield* Scope.make()
      const handle = yield* vmm.start(fakeSpec(dir)).pipe(Scope.extend(scope))
      expect(alive(handle.vmmPid)).toBe(true)
      yield* Scope.close(scope, Exit.void)
      const outcome = yield* handle.outcome
      expect(outcome.how).toBe("signalled")
      expect(outcome.signal).toBe("SIGKILL")
      expect(outcome.consoleTail).toEqual(["boot line", "last words"])
      expect(alive(handle.vmmPid)).toBe(false)
      expect(alive(handle.helperPid)).toBe(false)
    }).pipe(Effect.provide(Executor))
  )

  it.live("a helper that ignores SIGTERM is SIGKILLed with its VMM and reaped", () =>
    Effect.gen(function* () {
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-close-"))
      const vmm = yield* makeQemuVmm({
        accel: "tcg",
        helper: [process.execPath, fakeHelper(dir, "ignore")],
        note: () => undefined
      })
      const scope = yield* Scope.make()
      const handle = yield* vmm.start(fakeSpec(dir)).pipe(Scope.extend(scope))
      const started = Date.now()
      yield* Scope.close(scope, Exit.void)
      const outcome = yield* handle.outcome
      expect(outcome.how).toBe("killed")
      expect(Date.now() - started).toBeLessThan(3000)
      expect(alive(handle.vmmPid)).toBe(false)
      expect(alive(handle.helperPid)).toBe(false)
      }).pipe(Effect.provide(Executor))
  )
})

describe.skipIf(skip !== undefined)("Close of a real VM whose guest ignores shutdown", () => {
  it.live(
    "the shutdown RPC is ignored, the graceful bound passes, the helper signal ends the VM",
    () =>
      Effect.gen(function* () {
        const image = yield* Effect.promise(() => ensureTestImage())
        const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-close-vm-"))
        yield* cloneDisk(image.rootDisk, path.join(dir, "root.raw"))
        const scope = yield* Scope.make()
        const { vm, connection } = yield* bootSession(
          image,
          dir,
          { ignoreShutdown: true },
          {
            graceful: "2 seconds",
            signalled: "10 seconds",
            killed: "5 seconds"
          },
          "2 seconds"
        ).pipe(Scope.extend(scope))
        expect(connection.hello.protocol).toBe(4)
        yield* Scope.close(scope, Exit.void)
        const outcome = yield* vm.outcome
        expect(outcome.how).toBe("signalled")
        expect(outcome.consoleTail?.length ?? 0).toBeGreaterThan(0)
        expect(processesMentioning(dir)).toEqual([])
        fs.rmSync(dir, { recursive: true, force: true })
      }).pipe(Effect.provide(vmLayer)),
    240_000
  )
})

describe.skipIf(!hasQemu)("the automatic accelerator choice", () => {
  it.live("is probed and said once, then remembered for this host boot and QEMU binary", () =>
    Effect.gen(function* () {
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-accel-"))
      const accelCache = path.join(dir, "cache", "accel.json")
      const notes: Array<string> = []
      const startOnce = Effect.gen(function* () {
        const vmm = yield* makeQemuVmm({
          accel: "auto",
          accelCache,
          helper: [process.execPath, fakeHelper(dir, "exit")],
          note: (message) => notes.push(message)
        })
        yield* Effect.scoped(vmm.start(fakeSpec(dir)))
      })
      yield* startOnce
      const first = JSON.parse(fs.readFileSync(accelCache, "utf8")) as { key: string; accel: string }
      expect(["kvm", "tcg"]).toContain(first.accel)
      expect(first.key).toContain("qemu-system-x86_64")
      expect((fs.statSync(accelCache).mode & 0o777).toString(8)).toBe("600")
      const noted = notes.length
      yield* startOnce
      expect(notes.length).toBe(noted) // remembered: no second probe, no second note
      // a record for another boot or another binary is not trusted
      fs.writeFileSync(accelCache, JSON.stringify({ ...first, key: "another-boot" }))
      yield* startOnce
      expect(JSON.parse(fs.readFileSync(accelCache, "utf8"))).toEqual(first)
      }).pipe(Effect.provide(Executor))
  )
})
