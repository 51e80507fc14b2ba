/**
 * The memory state primitives in a real VM (QEMU under TCG, the busybox test image, the real
 * guest agent): a background loop a turn started is still counting after a save, a quit and a
 * restore; the guest answers `resumed` with a hello and takes the host's clock; the state file is
 * 0600 and smaller than the guest's memory; a state that does not fit (other -m, an edited
 * manifest) is refused before any VM starts.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Scope from "effect/Scope"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { cloneDisk, writeConfigDisk } from "../src/lib/disk.js"
import type { VmSpec } from "../src/domain/vm.js"
import { GuestRpc } from "../src/services/GuestRpc.js"
import { VmmBackend } from "../src/services/VmmBackend.js"
import { FEATURE_RESUME } from "../src/protocol/Messages.js"
import { ensureTestImage, runTurn, vmLayer, vmSkipReason } from "./e2e-vm-image.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e-memstate-vm: skipped: ${skip}`)

describe.skipIf(skip !== undefined)("memory state: save, quit, restore (real VM)", () => {
  it.live(
    "a turn's background loop counts on after save + restore; a state that does not fit is refused",
    () =>
      Effect.gen(function* () {
        const image = yield* Effect.promise(() => ensureTestImage())
        const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-memstate-"))
        yield* cloneDisk(image.rootDisk, path.join(dir, "root.raw"))
        yield* writeConfigDisk(path.join(dir, "config.raw"), {
          format: 1,
          sessionId: path.basename(dir),
          model: "test"
        })
        const lockFd = fs.openSync(path.join(dir, "lock"), "a")
        const spec: VmSpec = {
          sessionId: path.basename(dir),
          sessionDir: dir,
          arch: image.arch,
          kernel: image.kernel,
          initrd: image.initrd,
          rootDisk: path.join(dir, "root.raw"),
          configDisk: path.join(dir, "config.raw"),
          rpcSocket: path.join(dir, "rpc.sock"),
          consoleLog: path.join(dir, "console.log"),
          cpus: 2,
          memoryMiB: 512,
          lockFd,
          bounds: { graceful: "15 seconds", signalled: "5 seconds", killed: "5 seconds" }
        }
        const rpc = yield* GuestRpc
        const vmm = yield* VmmBackend
        const statePath = path.join(dir, "memory.state")
        const options = { helloTimeout: "90 seconds", shutdownTimeout: "15 seconds" } as const

        // boot, start a loop that outlives its turn, save and quit
        const scope1 = yield* Scope.make()
        const listener1 = yield* rpc.listen(spec.rpcSocket, options).pipe(Scope.extend(scope1))
        const vm1 = yield* vmm.start(spec).pipe(Scope.extend(scope1))
        const conn1 = yield* listener1.accept.pipe(Scope.extend(scope1))
        expect(conn1.hello.features).toContain(FEATURE_RESUME)
        yield* runTurn(
          conn1,
          "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done' </dev/null >/dev/null 2>&1 & sleep 0.5; cat /tmp/counter"
        )
        const before = Number((yield* runTurn(conn1, "cat /tmp/counter")).trim())
        expect(before).toBeGreaterThan(0)
        const manifest = yield* vm1.saveState!({
          statePath,
          then: "quit",
          imageDigest: image.identity.digest
        })
        const exit1 = yield* vm1.exited
        expect(exit1.exitCode).toBe(0)
        yield* Scope.close(scope1, Exit.void)

        expect(fs.statSync(statePath).mode & 0o777).toBe(0o600)
        expect(manifest.bytes).toBeGreaterThan(0)
        expect(manifest.bytes).toBeLessThan(spec.memoryMiB * 1024 * 1024)
        expect(manifest.machine).toMatch(/^pc-q35-/)
        expect(manifest.memoryMiB).toBe(512)

        // a state that does not fit is refused before a VM starts
        const wrongMemory = yield* Effect.flip(
          Effect.scoped(
            vmm.restore!(
              { ...spec, memoryMiB: 1024 },
              { statePath, manifest, imageDigest: image.identity.digest }
            )
          )
        )
        expect(wrongMemory._tag).toBe("StateMismatch")
        const edited = yield* Effect.flip(
          Effect.scoped(
            vmm.restore!(spec, {
              statePath,
              manifest: { ...manifest, layoutDigest: "0".repeat(64) },
              imageDigest: image.identity.digest
            })
          )
        )
        expect(edited._tag).toBe("StateMismatch")
        expect(edited.message).toContain("device layout")

        // restore: the loop counts on, the turn after it runs, the guest's clock is the host's
        const scope2 = yield* Scope.make()
        const listener2 = yield* rpc.listen(spec.rpcSocket, options).pipe(Scope.extend(scope2))
        const started = Date.now()
        yield* vmm.restore!(spec, { statePath, manifest, imageDigest: image.identity.digest }).pipe(
          Scope.extend(scope2)
        )
        const conn2 = yield* listener2.acceptResumed({}).pipe(Scope.extend(scope2))
        const restoreMillis = Date.now() - started
        const after = yield* runTurn(
          conn2,
          "a=$(cat /tmp/counter); sleep 1; b=$(cat /tmp/counter); date +%s; echo $a $b"
        )
        const [clock, counts] = after.trim().split("\n")
        const [a, b] = counts!.split(" ").map(Number)
        expect(a).toBeGreaterThanOrEqual(before)
        expect(b).toBeGreaterThan(a!)
        expect(Math.abs(Number(clock) - Date.now() / 1000)).toBeLessThan(10)
        console.log(
          `restore to hello: ${restoreMillis} ms, state ${manifest.bytes} bytes (${manifest.compression})`
        )
        yield* Scope.close(scope2, Exit.void)
        fs.closeSync(lockFd)
        fs.rmSync(dir, { recursive: true, force: true })
      }).pipe(Effect.provide(vmLayer)),
    240_000
  )
})
