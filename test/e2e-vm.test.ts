import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Chunk from "effect/Chunk"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as crypto from "node:crypto"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { cloneDisk } from "../src/lib/disk.js"
import { FEATURE_OUTPUT } from "../src/protocol/Messages.js"
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
        // large output, byte-exact, on the turn's output channel: random (not UTF-8) bytes on
        // stdout and seq on stderr, checked against the guest's own digest of what it wrote
        expect(second.connection.hello.features).toContain(FEATURE_OUTPUT)
        const big = Chunk.toReadonlyArray(
          yield* Stream.runCollect(
            second.connection.turn("head -c 3000000 /dev/urandom | tee /tmp/big.bin; seq 1 300000 >&2")
          )
        )
        const streamBytes = (kind: string) =>
          Buffer.concat(
            big.flatMap((e) => (e._tag === "Event" && e.event.kind === kind && e.bytes ? [e.bytes] : []))
          )
        const digest = yield* runTurn(second.connection, "sha256sum /tmp/big.bin")
        expect(streamBytes("stdout").length).toBe(3_000_000)
        expect(crypto.createHash("sha256").update(streamBytes("stdout")).digest("hex")).toBe(
          digest.split(" ")[0]
        )
        expect(streamBytes("stderr").toString()).toBe(
          Array.from({ length: 300000 }, (_, i) => `${i + 1}\n`).join("")
        )
        expect(big.at(-1)).toMatchObject({ _tag: "End", exitCode: 0 })
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
