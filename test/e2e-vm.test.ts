import { describe, expect, it } from "@effect/vitest"
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { GuestRpcLive } from "../src/layers/GuestRpcLive.js"
import { QemuVmmLive } from "../src/layers/QemuVmm.js"
import { cloneDisk, writeConfigDisk } from "../src/lib/disk.js"
import type { GuestConfig } from "../src/protocol/GuestConfig.js"
import { GuestRpc } from "../src/services/GuestRpc.js"
import type { GoldenImage } from "../src/services/Images.js"
import { type CloseBounds, VmmBackend } from "../src/services/VmmBackend.js"
import { ensureTestImage, processesMentioning, vmSkipReason } from "./e2e-vm-image.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e-vm: skipped: ${skip}`)

const TestLayer = Layer.mergeAll(
  GuestRpcLive,
  QemuVmmLive({ note: () => undefined }),
  NodeCommandExecutor.layer.pipe(Layer.provide(NodeFileSystem.layer))
)

export const bootSession = (
  image: GoldenImage,
  dir: string,
  config: Partial<GuestConfig> = {},
  bounds: CloseBounds = { graceful: "15 seconds", signalled: "5 seconds", killed: "5 seconds" }
) =>
  Effect.gen(function* () {
    const id = path.basename(dir)
    yield* writeConfigDisk(path.join(dir, "config.raw"), {
      format: 1,
      sessionId: id,
      model: "test",
      ...config
    })
    const lockFd = yield* Effect.acquireRelease(
      Effect.sync(() => fs.openSync(path.join(dir, "lock"), "a")),
      (fd) => Effect.sync(() => fs.closeSync(fd))
    )
    const rpc = yield* GuestRpc
    const vmm = yield* VmmBackend
    const rpcSocket = path.join(dir, "rpc.sock")
    const listener = yield* rpc.listen(rpcSocket, {
      helloTimeout: "90 seconds",
      shutdownTimeout: "15 seconds"
    })
    const vm = yield* vmm.start({
      sessionId: id,
      sessionDir: dir,
      arch: image.arch,
      kernel: image.kernel,
      initrd: image.initrd,
      rootDisk: path.join(dir, "root.raw"),
      configDisk: path.join(dir, "config.raw"),
      rpcSocket,
      consoleLog: path.join(dir, "console.log"),
      cpus: 2,
      memoryMiB: 1024,
      lockFd,
      bounds
    })
    const connection = yield* listener.accept
    return { vm, connection }
  })

export const runTurn = (
  connection: { turn: (text: string) => Stream.Stream<{ _tag: string }, unknown> },
  text: string
) =>
  Stream.runCollect(connection.turn(text)).pipe(
    Effect.map((events) =>
      Chunk.toReadonlyArray(events)
        .flatMap((e) => {
          const event = (e as { event?: { kind: string; data?: string } }).event
          return event?.kind === "stdout" && event.data !== undefined ? [event.data] : []
        })
        .join("")
    )
  )

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

        // second boot of the same root.raw
        const scope2 = yield* Scope.make()
        const second = yield* bootSession(image, dir).pipe(Scope.extend(scope2))
        const text = yield* runTurn(second.connection, "cat /work/repo/persist.txt; id -u")
        expect(text).toContain(token)
        expect(text.trim().split("\n").at(-1)).toBe("1000")
        yield* Scope.close(scope2, Exit.void)
        expect((yield* second.vm.outcome).how).toBe("graceful")
        expect(processesMentioning(dir)).toEqual([])
        expect(fs.readFileSync(path.join(dir, "console.log"), "utf8")).toContain("abox-init: started")
        fs.rmSync(dir, { recursive: true, force: true })
      }).pipe(Effect.provide(TestLayer)),
    300_000
  )
})
