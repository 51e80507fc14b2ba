/**
 * Copy-on-write root disks (docs/on-disk.md "The root disk") through the programs, with FakeVmm
 * (the real guest agent in-process) attaching a qcow2 root, a real registered image, the real
 * store and lock, and real qemu-img: Open makes `root.qcow2` over the golden; list and show tell
 * the session's own bytes from the image's; `image rm` refuses while a session uses the image,
 * and `--force` makes the session standalone (a crash mid-way leaves it bootable); resume checks
 * the overlay (leaks repaired, corruption refused); a session made before overlays boots its
 * root.raw as before and says so.
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { execFileSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { HttpsBrokerLive } from "../src/broker/HttpsBrokerLive.js"
import * as FakeVmm from "../src/layers/FakeVmm.js"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { ImagesLive } from "../src/layers/ImagesLive.js"
import { RuntimeLockLive } from "../src/layers/RuntimeLockLive.js"
import { SessionStoreLive } from "../src/layers/SessionStoreLive.js"
import { registerImage, resolveImage } from "../src/lib/images.js"
import { imageList, imageRemove } from "../src/programs/image.js"
import { listSessions } from "../src/programs/list.js"
import { open, resume } from "../src/programs/session.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { SessionStore } from "../src/services/SessionStore.js"

const qemuImg = ["/usr/bin/qemu-img", "/usr/local/bin/qemu-img"].find((f) => fs.existsSync(f))
const tempDir = (prefix: string) => fs.mkdtempSync(path.join(os.tmpdir(), prefix))

const layerFor = (home: string) =>
  Layer.mergeAll(
    SessionStoreLive,
    RuntimeLockLive,
    GuestRpcLive,
    HttpsBrokerLive,
    FakeVmm.layerWith({ rootDiskFormat: "qcow2" }),
    ImagesLive
  ).pipe(
    Layer.provideMerge(aboxPathsAt(home)),
    Layer.provideMerge(NodeCommandExecutor.layer),
    Layer.provideMerge(NodeFileSystem.layer)
  )

/** a registered image whose golden root.raw holds 4 MiB of data in a 64 MiB disk */
const registerGolden = (home: string) => {
  const imagesDir = path.join(home, "images")
  fs.mkdirSync(imagesDir, { recursive: true })
  const staging = fs.mkdtempSync(path.join(imagesDir, ".build-"))
  fs.writeFileSync(path.join(staging, "vmlinuz"), "kernel bytes")
  fs.writeFileSync(path.join(staging, "initrd.gz"), "initrd bytes")
  const root = path.join(staging, "root.raw")
  fs.writeFileSync(root, Buffer.alloc(4 * 1024 * 1024, 0x5a))
  fs.truncateSync(root, 64 * 1024 * 1024)
  return registerImage(
    imagesDir,
    staging,
    {
      name: "abox",
      variant: "small",
      arch: process.arch === "arm64" ? "aarch64" : "x86_64",
      kernel: "6.1.0-test",
      node: "20.20.2",
      agent: "a".repeat(64),
      protocol: 4
    },
    { makeDefault: true }
  )
}

const vmSpecOf = (dir: string) =>
  JSON.parse(fs.readFileSync(FakeVmm.fakeGuestPaths(dir).vmSpec, "utf8")) as {
    kernel: string
    initrd: string
    rootDisk: string
    rootDiskFormat: string
  }

const qemuInfo = (file: string) =>
  JSON.parse(execFileSync(qemuImg!, ["info", "--output=json", "-U", file], { encoding: "utf8" })) as {
    "backing-filename"?: string
  }

describe.skipIf(qemuImg === undefined || process.platform !== "linux")(
  "copy-on-write root disks (FakeVmm, qcow2)",
  () => {
    it.live(
      "open makes an overlay; image rm refuses while it is used; --force interrupted mid-way leaves it bootable, then makes it standalone",
      () => {
        const home = tempDir("abox-cow-")
        const source = tempDir("abox-cow-src-")
        fs.writeFileSync(path.join(source, "README.md"), "# cow\n")
        return Effect.gen(function* () {
          const image = yield* registerGolden(home)
          const ref = `abox@${image.meta.digest}`
          const store = yield* SessionStore
          const { id, dir } = yield* Effect.scoped(
            Effect.map(open({ source, name: "cow" }), (session) => ({ id: session.id, dir: session.dir }))
          )
          const meta = yield* store.get(id)
          expect(meta.rootDisk).toEqual({ format: "qcow2", kind: "overlay", backing: image.meta.digest })
          const overlay = path.join(dir, "root.qcow2")
          expect(fs.existsSync(path.join(dir, "root.raw"))).toBe(false)
          expect(qemuInfo(overlay)["backing-filename"]).toBe(path.join(image.dir, "root.raw"))
          expect(vmSpecOf(dir)).toMatchObject({ rootDisk: overlay, rootDiskFormat: "qcow2" })

          // own bytes (the overlay) apart from the image's, which list and image list count once
          const [row] = yield* listSessions()
          expect(row!.sharedBytes).toBeGreaterThanOrEqual(4 * 1024 * 1024)
          expect(row!.bytes).toBeLessThan(2 * 1024 * 1024)
          const listed = (yield* imageList()).images[0]!
          expect(listed.sessions).toBe(1)
          expect(listed.sharedBytes).toBe(row!.sharedBytes)

          // refused, with the session named; nothing changes
          const refused = yield* Effect.flip(imageRemove(ref, false))
          expect(refused._tag).toBe("ImageInUse")
          if (refused._tag === "ImageInUse") {
            expect(refused.sessions).toEqual([id])
            expect(refused.message).toContain("cow")
          }
          // --force does not help a running session... (its lock is held)
          // a crash between the kernel copy and the disk's rename: the image stays, the session boots
          const crashed = yield* Effect.exit(
            imageRemove(ref, true, (step) => (step === "disk" ? Effect.die("power loss") : Effect.void))
          )
          expect(crashed._tag).toBe("Failure")
          expect(fs.existsSync(image.dir)).toBe(true)
          expect(qemuInfo(overlay)["backing-filename"]).toBe(path.join(image.dir, "root.raw"))
          expect(fs.existsSync(path.join(dir, "vmlinuz"))).toBe(true)
          yield* Effect.scoped(resume(id))
          expect(vmSpecOf(dir)).toMatchObject({ kernel: path.join(dir, "vmlinuz"), rootDiskFormat: "qcow2" })
          // still an overlay of it: still in use
          expect((yield* Effect.flip(imageRemove(ref, false)))._tag).toBe("ImageInUse")

          const golden = path.join(home, "golden-copy.raw")
          fs.copyFileSync(path.join(image.dir, "root.raw"), golden)
          const removed = yield* imageRemove(ref, true)
          expect(removed.standalone).toEqual([id])
          expect(fs.existsSync(image.dir)).toBe(false)
          expect(qemuInfo(overlay)["backing-filename"]).toBeUndefined()
          // the standalone disk holds the golden's bytes
          execFileSync(qemuImg!, ["compare", "-q", "-f", "qcow2", "-F", "raw", overlay, golden])
          expect((yield* store.get(id)).rootDisk).toEqual({
            format: "qcow2",
            kind: "standalone",
            backing: image.meta.digest
          })
          yield* Effect.scoped(resume(id))
          expect(vmSpecOf(dir)).toMatchObject({
            kernel: path.join(dir, "vmlinuz"),
            initrd: path.join(dir, "initrd.gz"),
            rootDisk: overlay
          })
          expect(fs.readFileSync(vmSpecOf(dir).kernel, "utf8")).toBe("kernel bytes")
        }).pipe(Effect.provide(layerFor(home)))
      },
      60_000
    )

    it.live(
      "resume repairs an overlay's leaked clusters and refuses a corrupt one with a typed error",
      () => {
        const home = tempDir("abox-cow-")
        const source = tempDir("abox-cow-src-")
        fs.writeFileSync(path.join(source, "README.md"), "# cow\n")
        return Effect.gen(function* () {
          yield* registerGolden(home)
          const session = yield* Effect.scoped(
            Effect.map(open({ source }), (s) => ({ id: s.id, dir: s.dir }))
          )
          const overlay = path.join(session.dir, "root.qcow2")
          execFileSync("qemu-io", ["-c", "write -P 7 0 1M", overlay], { stdio: "ignore" })
          // a leak, as a VM killed between a cluster's allocation and its use leaves one: the
          // refcount block (cluster 2) counts a cluster past the image's end that nothing references
          const refblock = 2 * 65536
          const fd = fs.openSync(overlay, "r+")
          const clusters = Math.ceil(fs.fstatSync(fd).size / 65536)
          fs.writeSync(fd, Buffer.from([0, 1]), 0, 2, refblock + clusters * 2)
          fs.ftruncateSync(fd, (clusters + 1) * 65536)
          fs.closeSync(fd)
          expect(() => execFileSync(qemuImg!, ["check", "-q", overlay], { stdio: "ignore" })).toThrow()
          yield* Effect.scoped(resume(session.id))
          execFileSync(qemuImg!, ["check", "-q", overlay])

          // corruption (the refcount block zeroed): refused before boot, the disk left as it is
          const zeroed = fs.openSync(overlay, "r+")
          fs.writeSync(zeroed, Buffer.alloc(65536), 0, 65536, refblock)
          fs.closeSync(zeroed)
          const before = fs.readFileSync(overlay)
          const error = yield* Effect.flip(Effect.scoped(resume(session.id)))
          expect(error._tag).toBe("DiskError")
          if (error._tag === "DiskError") {
            expect(error.reason).toBe("corrupt")
            expect(error.path).toBe(overlay)
          }
          expect(fs.readFileSync(overlay).equals(before)).toBe(true)
        }).pipe(Effect.provide(layerFor(home)))
      },
      60_000
    )

    it.live(
      "a session made before overlays (root.raw, no rootDisk record) boots its root.raw and says so",
      () => {
        const home = tempDir("abox-cow-")
        const source = tempDir("abox-cow-src-")
        fs.writeFileSync(path.join(source, "README.md"), "# cow\n")
        return Effect.gen(function* () {
          const image = yield* registerGolden(home)
          const store = yield* SessionStore
          const session = yield* Effect.scoped(
            Effect.map(open({ source }), (s) => ({ id: s.id, dir: s.dir }))
          )
          // what an older abox left: a full root.raw copy and no rootDisk in session.json
          fs.rmSync(path.join(session.dir, "root.qcow2"))
          fs.copyFileSync(path.join(image.dir, "root.raw"), path.join(session.dir, "root.raw"))
          fs.chmodSync(path.join(session.dir, "root.raw"), 0o600)
          yield* store.update(session.id, ({ rootDisk: _dropped, ...rest }) => rest)
          yield* Effect.scoped(resume(session.id))
          expect(vmSpecOf(session.dir)).toMatchObject({
            rootDisk: path.join(session.dir, "root.raw"),
            rootDiskFormat: "raw",
            kernel: path.join(image.dir, "vmlinuz")
          })
          const [row] = yield* listSessions()
          expect(row!.sharedBytes).toBe(0)
          // it boots the image's kernel: image rm still refuses
          const refused = yield* Effect.flip(imageRemove(`abox@${image.meta.digest}`, false))
          expect(refused._tag).toBe("ImageInUse")
          expect((yield* resolveImage(path.join(home, "images"), undefined)).dir).toBe(image.dir)
        }).pipe(Effect.provide(layerFor(home)))
      },
      60_000
    )
  }
)
