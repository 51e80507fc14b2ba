import { describe, expect, it } from "@effect/vitest"
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { execFileSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { checkFreeSpace, cloneDisk, writeConfigDisk } from "../src/lib/disk.js"
import { imageDigest, listImages, registerImage, removeImage, resolveImage } from "../src/lib/images.js"
import { ImagesLive } from "../src/layers/ImagesLive.js"
import { sharedBytesSync } from "../src/lib/rootDisk.js"
import { decodeConfigDisk } from "../src/protocol/ConfigDisk.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { Images } from "../src/services/Images.js"

const qemuImg = ["/usr/bin/qemu-img", "/usr/local/bin/qemu-img", "/opt/homebrew/bin/qemu-img"].find((f) =>
  fs.existsSync(f)
)
const Exec = NodeCommandExecutor.layer.pipe(Layer.provide(NodeFileSystem.layer))
const identity = (name: string, agent = "a".repeat(64)) => ({
  name,
  variant: "small" as const,
  arch: "x86_64" as const,
  kernel: "6.1.0-test",
  node: "20.20.2",
  agent,
  protocol: 4
})

const stage = (imagesDir: string, content: string) => {
  const dir = fs.mkdtempSync(path.join(imagesDir, ".build-"))
  fs.writeFileSync(path.join(dir, "vmlinuz"), `kernel ${content}`)
  fs.writeFileSync(path.join(dir, "initrd.gz"), `initrd ${content}`)
  fs.writeFileSync(path.join(dir, "root.raw"), "")
  fs.truncateSync(path.join(dir, "root.raw"), 64 * 1024 * 1024)
  return dir
}

describe("image registry", () => {
  it.effect(
    "register → list → resolve (default, name, name@prefix) → rm refuses the default unless forced",
    () =>
      Effect.gen(function* () {
        const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-img-"))
        const images = path.join(home, "images")
        fs.mkdirSync(images)
        const first = yield* registerImage(images, stage(images, "one"), identity("abox"), {
          makeDefault: true
        })
        const second = yield* registerImage(images, stage(images, "two"), identity("abox"), {
          makeDefault: false
        })
        expect(first.meta.digest).not.toBe(second.meta.digest)
        expect(first.dir).toBe(path.join(images, "abox", first.meta.digest))
        expect(fs.readdirSync(first.dir).sort()).toEqual(["image.json", "initrd.gz", "root.raw", "vmlinuz"])
        // the digest is over the identity and the three file digests
        expect(first.meta.digest).toBe(
          imageDigest(identity("abox"), {
            kernel: first.meta.files.kernel.sha256,
            initrd: first.meta.files.initrd.sha256,
            root: first.meta.files.root.sha256
          })
        )
        const { images: listed } = yield* listImages(images)
        expect(listed.map((i) => i.meta.digest).sort()).toEqual(
          [first.meta.digest, second.meta.digest].sort()
        )
        expect((yield* resolveImage(images, undefined)).meta.digest).toBe(first.meta.digest)
        expect((yield* resolveImage(images, "abox")).meta.digest).toBe(first.meta.digest)
        expect((yield* resolveImage(images, `abox@${second.meta.digest.slice(0, 10)}`)).meta.digest).toBe(
          second.meta.digest
        )
        const missing = yield* resolveImage(images, "nope").pipe(Effect.flip)
        expect(missing._tag).toBe("ImageNotFound")

        const refused = yield* removeImage(images, `abox@${first.meta.digest}`, false).pipe(Effect.flip)
        expect(refused._tag).toBe("ImageInUse")
        yield* removeImage(images, `abox@${second.meta.digest}`, false)
        expect(fs.existsSync(second.dir)).toBe(false)
        yield* removeImage(images, `abox@${first.meta.digest}`, true)
        expect(fs.existsSync(first.dir)).toBe(false)
        expect((yield* resolveImage(images, undefined).pipe(Effect.flip))._tag).toBe("ImageNotFound")
        fs.rmSync(home, { recursive: true, force: true })
      })
  )

  it.effect("a corrupt image.json is skipped with its reason, never deleted", () =>
    Effect.gen(function* () {
      const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-img-"))
      const images = path.join(home, "images")
      const bad = path.join(images, "abox", "f".repeat(64))
      fs.mkdirSync(bad, { recursive: true })
      fs.writeFileSync(path.join(bad, "image.json"), '{"format": 99}')
      const { images: listed, problems } = yield* listImages(images)
      expect(listed).toEqual([])
      expect(problems[0]).toContain("image.json")
      expect(fs.existsSync(path.join(bad, "image.json"))).toBe(true)
      fs.rmSync(home, { recursive: true, force: true })
    })
  )

  it.effect("Images service: resolve the default and clone its root (sparse, 0600)", () =>
    Effect.gen(function* () {
      const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-img-"))
      const imagesDir = path.join(home, "images")
      fs.mkdirSync(imagesDir)
      yield* registerImage(imagesDir, stage(imagesDir, "x"), identity("abox"), { makeDefault: true })
      const result = yield* Effect.gen(function* () {
        const images = yield* Images
        const golden = yield* images.resolve(undefined)
        expect(golden.protocol).toBe(4)
        const root = yield* images.cloneRoot(golden, home, false)
        expect(root.file).toBe(path.join(home, "root.raw"))
        expect(root.info.format).toBe("raw")
        expect(root.info.backing).toBe(golden.identity.digest)
        return fs.statSync(root.file)
      }).pipe(Effect.provide(ImagesLive.pipe(Layer.provide(Layer.mergeAll(aboxPathsAt(home), Exec)))))
      expect(result.size).toBe(64 * 1024 * 1024)
      expect(result.blocks * 512).toBeLessThan(1024 * 1024)
      expect(result.mode & 0o777).toBe(0o600)
      fs.rmSync(home, { recursive: true, force: true })
    })
  )

  it.effect.skipIf(!qemuImg)(
    "Images service with overlay: root.qcow2 over the golden's absolute root.raw, O(1) whatever its size",
    () =>
      Effect.gen(function* () {
        const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-img-"))
        const imagesDir = path.join(home, "images")
        fs.mkdirSync(imagesDir)
        const staging = stage(imagesDir, "x")
        // a golden with 32 MiB of data: an overlay does not copy it
        const data = fs.openSync(path.join(staging, "root.raw"), "r+")
        fs.writeSync(data, Buffer.alloc(32 * 1024 * 1024, 7), 0, 32 * 1024 * 1024, 0)
        fs.closeSync(data)
        yield* registerImage(imagesDir, staging, identity("abox"), { makeDefault: true })
        const { golden, root } = yield* Effect.gen(function* () {
          const images = yield* Images
          const golden = yield* images.resolve(undefined)
          return { golden, root: yield* images.cloneRoot(golden, home, true) }
        }).pipe(Effect.provide(ImagesLive.pipe(Layer.provide(Layer.mergeAll(aboxPathsAt(home), Exec)))))
        // this filesystem may reflink (then root.raw, O(1) too); else the overlay
        if (root.info.kind === "reflink") {
          expect(root.file).toBe(path.join(home, "root.raw"))
        } else {
          expect(root.info).toEqual({ format: "qcow2", kind: "overlay", backing: golden.identity.digest })
          expect(root.file).toBe(path.join(home, "root.qcow2"))
          const stat = fs.statSync(root.file)
          expect(stat.mode & 0o777).toBe(0o600)
          expect(stat.blocks * 512).toBeLessThan(1024 * 1024)
          const info = JSON.parse(
            execFileSync(qemuImg!, ["info", "--output=json", "-U", root.file], { encoding: "utf8" })
          ) as {
            "backing-filename": string
            "backing-filename-format": string
            "format-specific": { data: { "lazy-refcounts": boolean } }
          }
          expect(info["backing-filename"]).toBe(golden.rootDisk)
          expect(path.isAbsolute(info["backing-filename"])).toBe(true)
          expect(info["backing-filename-format"]).toBe("raw")
          expect(info["format-specific"].data["lazy-refcounts"]).toBe(false)
        }
        fs.rmSync(home, { recursive: true, force: true })
      })
  )
})

describe("disks", () => {
  it.effect("clone keeps holes and content; a clone that cannot fit fails with a typed error", () =>
    Effect.gen(function* () {
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-disk-"))
      const src = path.join(dir, "golden.raw")
      fs.writeFileSync(src, "")
      fs.truncateSync(src, 512 * 1024 * 1024)
      const fd = fs.openSync(src, "r+")
      fs.writeSync(fd, Buffer.from("data in the middle"), 0, 18, 100 * 1024 * 1024)
      fs.closeSync(fd)
      const result = yield* cloneDisk(src, path.join(dir, "clone.raw")).pipe(Effect.provide(Exec))
      expect(["reflink", "sparse-copy"]).toContain(result.method)
      expect(result.allocated).toBeLessThan(1024 * 1024)
      expect(execFileSync("cmp", [src, path.join(dir, "clone.raw")]).length).toBe(0)
      const tooBig = yield* checkFreeSpace(dir, Number.MAX_SAFE_INTEGER / 2).pipe(Effect.flip)
      expect(tooBig.reason).toBe("no-space")
      expect(tooBig.message).toContain("not enough free space")
      fs.rmSync(dir, { recursive: true, force: true })
    })
  )

  it.effect(
    "every disk made is a whole MiB (vfkit refuses a size not a multiple of 512): an odd golden's clone grows, its bytes kept",
    () =>
      Effect.gen(function* () {
        const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-disk-"))
        const src = path.join(dir, "golden.raw")
        fs.writeFileSync(src, Buffer.from("odd-sized golden"))
        fs.truncateSync(src, 3 * 1024 * 1024 + 4)
        const clone = path.join(dir, "clone.raw")
        yield* cloneDisk(src, clone).pipe(Effect.provide(Exec))
        expect(fs.statSync(clone).size).toBe(4 * 1024 * 1024)
        expect(
          fs
            .readFileSync(clone)
            .subarray(0, 3 * 1024 * 1024 + 4)
            .equals(fs.readFileSync(src))
        ).toBe(true)
        // the golden itself is left as it is
        expect(fs.statSync(src).size).toBe(3 * 1024 * 1024 + 4)
        const config = path.join(dir, "config.raw")
        yield* writeConfigDisk(config, { format: 1, sessionId: "s1", model: "m".repeat(5000) })
        expect(fs.statSync(config).size % 512).toBe(0)
        fs.rmSync(dir, { recursive: true, force: true })
      })
  )

  it.effect("config.raw: written atomically with mode 0600 and decodes back", () =>
    Effect.gen(function* () {
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-disk-"))
      const file = path.join(dir, "config.raw")
      yield* writeConfigDisk(file, { format: 1, sessionId: "s1", model: "m" })
      expect(fs.statSync(file).mode & 0o777).toBe(0o600)
      const decoded = decodeConfigDisk(fs.readFileSync(file))
      expect(decoded._tag === "Right" && decoded.right.sessionId).toBe("s1")
      expect(fs.readdirSync(dir)).toEqual(["config.raw"])
      fs.rmSync(dir, { recursive: true, force: true })
    })
  )

  it.effect("a session of an environment image shares its overlay and its base's root (list's SHARED)", () =>
    Effect.gen(function* () {
      const images = fs.mkdtempSync(path.join(os.tmpdir(), "abox-img-shared-"))
      const baseStage = stage(images, "base")
      fs.writeFileSync(path.join(baseStage, "root.raw"), Buffer.alloc(256 * 1024, 1))
      const base = yield* registerImage(images, baseStage, identity("abox"), { makeDefault: true })
      const envStage = fs.mkdtempSync(path.join(images, ".env-"))
      fs.writeFileSync(path.join(envStage, "vmlinuz"), "kernel base")
      fs.writeFileSync(path.join(envStage, "initrd.gz"), "initrd base")
      fs.writeFileSync(path.join(envStage, "root.qcow2"), Buffer.alloc(64 * 1024, 2))
      const env = yield* registerImage(images, envStage, identity("env-0123456789abcdef"), {
        makeDefault: false,
        rootFile: "root.qcow2",
        environment: {
          key: "0".repeat(64),
          base: { name: base.meta.name, digest: base.meta.digest },
          source: "/repo",
          file: ".abox/environment.json",
          granted: [],
          setupSeconds: 1,
          overlayBytes: 64 * 1024
        }
      })
      const blocks = (file: string) => fs.statSync(file).blocks * 512
      const overlay = { format: "qcow2" as const, kind: "overlay" as const, backing: "x" }
      expect(sharedBytesSync(images, base.meta, overlay)).toBe(blocks(path.join(base.dir, "root.raw")))
      expect(sharedBytesSync(images, env.meta, overlay)).toBe(
        blocks(path.join(base.dir, "root.raw")) + blocks(path.join(env.dir, "root.qcow2"))
      )
      expect(sharedBytesSync(images, env.meta, { ...overlay, kind: "copy" })).toBe(0)
      fs.rmSync(images, { recursive: true, force: true })
    })
  )
})
