/**
 * A qcow2 root session in a real VM (QEMU, real kernel, real guest agent, the busybox test
 * image): Open makes `root.qcow2` over the golden's root.raw and the VM boots it; the guest's
 * deletes reach the host (64 MiB written and removed: the overlay's allocated bytes go back
 * down); the balloon driver is loaded (free page reporting); the session resumes with its work
 * on the overlay and gives its diff; `rm` frees the overlay and leaves the golden as it was.
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { HttpsBrokerLive } from "../src/broker/HttpsBrokerLive.js"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { ImagesLive } from "../src/layers/ImagesLive.js"
import { QemuVmmLive } from "../src/layers/QemuVmm.js"
import { RuntimeLockLive } from "../src/layers/RuntimeLockLive.js"
import { SessionStoreLive } from "../src/layers/SessionStoreLive.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import * as Repo from "../src/programs/repo.js"
import { imageRemove } from "../src/programs/image.js"
import { execFileSync } from "node:child_process"
import { remove } from "../src/programs/remove.js"
import { open, resume } from "../src/programs/session.js"
import { SessionStore } from "../src/services/SessionStore.js"
import { ensureTestImage, runTurn, testHome, vmSkipReason } from "./e2e-vm-image.js"

const layerFor = (home: string) =>
  Layer.mergeAll(
    SessionStoreLive,
    RuntimeLockLive,
    GuestRpcLive,
    HttpsBrokerLive,
    QemuVmmLive({ note: () => undefined }),
    ImagesLive
  ).pipe(
    Layer.provideMerge(aboxPathsAt(home)),
    Layer.provideMerge(NodeCommandExecutor.layer),
    Layer.provideMerge(NodeFileSystem.layer)
  )

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e-cow-vm: skipped: ${skip}`)

const allocated = (file: string) => fs.statSync(file).blocks * 512
const MiB = 1024 * 1024

describe.skipIf(skip !== undefined)("a qcow2 root session in a real VM", () => {
  it.live(
    "open on an overlay → 64 MiB written and deleted gives the host its blocks back → resume keeps the work → diff → rm frees the overlay only",
    () => {
      const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-cow-vm-"))
      const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-cow-vm-src-"))
      fs.writeFileSync(path.join(source, "README.md"), "# cow\n")
      return Effect.gen(function* () {
        const image = yield* Effect.promise(() => ensureTestImage())
        fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
        const goldenBefore = fs.statSync(image.rootDisk)
        const store = yield* SessionStore

        const { id, dir } = yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* open({ source, memoryMiB: 512 })
            const overlay = path.join(session.dir, "root.qcow2")
            expect(session.meta.rootDisk).toEqual({
              format: "qcow2",
              kind: "overlay",
              backing: image.identity.digest
            })
            expect(fs.existsSync(path.join(session.dir, "root.raw"))).toBe(false)
            // booted and working on the overlay: a small fraction of the golden
            expect(allocated(overlay)).toBeLessThan(allocated(image.rootDisk) / 10)

            const facts = yield* runTurn(
              session.connection,
              "grep ' / ' /proc/mounts; ls /sys/bus/virtio/drivers/; echo kept > $HOME/kept.txt; sync"
            )
            expect(facts).toMatch(/\/dev\/vda \/ ext4 [^ ]*discard/)
            expect(facts).toContain("virtio_balloon")

            const before = allocated(overlay)
            yield* runTurn(
              session.connection,
              "dd if=/dev/zero of=$HOME/big bs=1M count=64 2>/dev/null; sync"
            )
            const written = allocated(overlay)
            expect(written - before).toBeGreaterThan(48 * MiB)
            yield* runTurn(session.connection, "rm $HOME/big; sync; sleep 1; sync")
            const freed = allocated(overlay)
            console.error(
              `e2e-cow-vm: overlay ${(before / MiB).toFixed(1)} MiB → ${(written / MiB).toFixed(1)} after 64 MiB → ${(freed / MiB).toFixed(1)} after rm`
            )
            expect(freed - before).toBeLessThan(8 * MiB)
            expect(yield* runTurn(session.connection, "echo changed >> README.md")).toBe("")
            return { id: session.id, dir: session.dir }
          })
        )
        expect((yield* store.get(id)).lastClose?.how).toBe("graceful")

        // resumed from the overlay (qemu-img check first): the work is there
        yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* resume(id, { memoryMiB: 512 })
            expect((yield* runTurn(session.connection, "cat $HOME/kept.txt")).trim()).toBe("kept")
            const patch = yield* Repo.diff(session.connection)
            expect(patch).toContain("+changed")
          })
        )

        yield* remove([id])
        expect(fs.existsSync(dir)).toBe(false)
        const goldenAfter = fs.statSync(image.rootDisk)
        expect(goldenAfter.size).toBe(goldenBefore.size)
        expect(goldenAfter.mtimeMs).toBe(goldenBefore.mtimeMs)
        expect(goldenAfter.mode & 0o777).toBe(0o444)
      }).pipe(Effect.provide(layerFor(home)))
    },
    600_000
  )

  it.live(
    "image rm refuses while the session uses its image; --force makes it standalone and it boots with the image gone",
    () => {
      const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-cow-vm-rm-"))
      const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-cow-vm-src-"))
      fs.writeFileSync(path.join(source, "README.md"), "# cow\n")
      return Effect.gen(function* () {
        const shared = yield* Effect.promise(() => ensureTestImage())
        // a registry of this test's own (the shared test image is never removed): the image copied
        const imageDir = path.join(home, "images", shared.identity.name, shared.identity.digest)
        fs.mkdirSync(path.dirname(imageDir), { recursive: true })
        execFileSync("cp", [
          "-a",
          "--reflink=auto",
          "--sparse=always",
          path.dirname(shared.rootDisk),
          imageDir
        ])
        fs.writeFileSync(
          path.join(home, "images", "default.json"),
          JSON.stringify({ format: 1, name: shared.identity.name, digest: shared.identity.digest })
        )
        const ref = `${shared.identity.name}@${shared.identity.digest}`
        const id = yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* open({ source, memoryMiB: 512 })
            yield* runTurn(session.connection, "echo before-rm > $HOME/mark.txt; sync")
            return session.id
          })
        )
        const refused = yield* Effect.flip(imageRemove(ref, false))
        expect(refused._tag).toBe("ImageInUse")
        const removed = yield* imageRemove(ref, true)
        expect(removed.standalone).toEqual([id])
        expect(fs.existsSync(imageDir)).toBe(false)
        yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* resume(id, { memoryMiB: 512 })
            expect((yield* runTurn(session.connection, "cat $HOME/mark.txt")).trim()).toBe("before-rm")
          })
        )
      }).pipe(Effect.provide(layerFor(home)))
    },
    600_000
  )
})
