import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Scope from "effect/Scope"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { cloneDisk } from "../src/lib/disk.js"
import {
  alive,
  bootSession,
  ensureTestImage,
  processesMentioning,
  runTurn,
  vmLayer,
  vmSkipReason
} from "./e2e-vm-image.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e-vm: skipped: ${skip}`)

const TestLayer = vmLayer

describe.skipIf(skip !== undefined)("QEMU end to end (real kernel, real guest agent)", () => {
  it.live(
    "boot → hello → uname -r is the image's kernel; a file survives a second boot; close leaves no process",
    () =>
      Effect.gen(function* () {
        const image = yield* Effect.promise(() => ensureTestImage())
        const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-"))
        yield* cloneDisk(image.rootDisk, path.join(dir, "root.raw"))
        const token = `persist-${Date.now()}`

        // first boot
        const scope1 = yield* Scope.make()
        const first = yield* bootSession(image, dir).pipe(Scope.extend(scope1))
        expect(first.connection.hello.protocol).toBe(4)
        expect(first.connection.hello.arch).toBe("x86_64")
        expect(processesMentioning(dir).length).toBeGreaterThan(0)
        const uname = yield* runTurn(first.connection, "uname -r")
        expect(uname.trim()).toBe(image.identity.kernel)
        yield* runTurn(first.connection, `echo ${token} > /work/repo/persist.txt && sync`)
        yield* Scope.close(scope1, Exit.void)
        const outcome1 = yield* first.vm.outcome
        expect(outcome1.how).toBe("graceful")
        expect(processesMentioning(dir)).toEqual([])
        expect(alive(first.vm.helperPid) || alive(first.vm.vmmPid)).toBe(false)

        // second boot of the same root.raw
        const scope2 = yield* Scope.make()
        const second = yield* bootSession(image, dir).pipe(Scope.extend(scope2))
        const text = yield* runTurn(second.connection, "cat /work/repo/persist.txt; id -u")
        expect(text).toContain(token)
        expect(text.trim().split("\n").at(-1)).toBe("1000")
        yield* Scope.close(scope2, Exit.void)
        expect((yield* second.vm.outcome).how).toBe("graceful")
        expect(processesMentioning(dir)).toEqual([])
        expect(alive(second.vm.helperPid) || alive(second.vm.vmmPid)).toBe(false)
        expect(fs.readFileSync(path.join(dir, "console.log"), "utf8")).toContain("abox-init: started")
        fs.rmSync(dir, { recursive: true, force: true })
      }).pipe(Effect.provide(TestLayer)),
    300_000
  )
})
