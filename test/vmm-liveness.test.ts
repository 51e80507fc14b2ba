import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Scope from "effect/Scope"
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import { createRequire } from "node:module"
import * as os from "node:os"
import * as path from "node:path"
import * as readline from "node:readline"
import { cloneDisk } from "../src/lib/disk.js"
import {
  alive,
  bootSession,
  ensureTestImage,
  processesMentioning,
  repoRoot,
  vmLayer,
  vmSkipReason
} from "./e2e-vm-image.js"

const skip = vmSkipReason()
const locks = createRequire(import.meta.url)("fs-native-extensions") as {
  tryLock: (fd: number) => boolean
  unlock: (fd: number) => void
}

describe.skipIf(skip !== undefined)("liveness: the supervisor dies, the VM goes with it", () => {
  it.live(
    "SIGKILL of the supervisor mid-session: no qemu or helper left within 3 s, lock free, the disk boots again",
    () =>
      Effect.gen(function* () {
        const image = yield* Effect.promise(() => ensureTestImage())
        const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-live-"))
        yield* cloneDisk(image.rootDisk, path.join(dir, "root.raw"))
        const supervisor = spawn(
          process.execPath,
          [
            "--import",
            "tsx",
            path.join(repoRoot, "test", "vmm-supervisor.fixture.ts"),
            dir,
            image.kernel,
            image.initrd
          ],
          { cwd: repoRoot, stdio: ["ignore", "pipe", "inherit"] }
        )
        const ready = yield* Effect.async<string>((resume) => {
          readline.createInterface({ input: supervisor.stdout! }).on("line", (line) => {
            if (line.startsWith("READY")) resume(Effect.succeed(line))
          })
        })
        const [, helperPid, vmmPid] = ready.split(" ").map(Number)
        expect(alive(helperPid!) && alive(vmmPid!)).toBe(true)
        expect(processesMentioning(dir)).toContain(vmmPid)
        const killedAt = Date.now()
        supervisor.kill("SIGKILL")
        // bounded check of a fact another process must make true: its processes are gone
        while ((processesMentioning(dir).length > 0 || alive(helperPid!)) && Date.now() - killedAt < 3000) {
          yield* Effect.sleep("50 millis")
        }
        expect(processesMentioning(dir)).toEqual([])
        expect(alive(helperPid!)).toBe(false)
        expect(alive(vmmPid!)).toBe(false)
        expect(Date.now() - killedAt).toBeLessThan(3000)
        const fd = fs.openSync(path.join(dir, "lock"), "a")
        expect(locks.tryLock(fd)).toBe(true)
        locks.unlock(fd)
        fs.closeSync(fd)

        const scope = yield* Scope.make()
        const again = yield* bootSession(image, dir).pipe(Scope.extend(scope))
        expect(again.connection.hello.protocol).toBe(4)
        yield* Scope.close(scope, Exit.void)
        expect(processesMentioning(dir)).toEqual([])
        fs.rmSync(dir, { recursive: true, force: true })
      }).pipe(Effect.provide(vmLayer)),
    240_000
  )
})
