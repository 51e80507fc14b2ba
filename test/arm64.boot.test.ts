/**
 * Optional: the arm64 `small` image (images/build-small.sh --arch aarch64) boots under
 * qemu-system-aarch64 (TCG, `virt` machine) to the guest agent's hello, runs a turn and powers
 * off on shutdown; in the same boot it checks what vfkit's vsock RPC channel needs in the guest
 * (the vsock modules loaded by the initrd, socat with its libraries, an AF_VSOCK connect reaching
 * the virtio transport) and that the image directory ships the uncompressed kernel `Image`.
 * Slow (full emulation of another architecture), so it runs only when asked
 * (`ABOX_TEST_ARM64=1`, which builds the image if needed) or when an arm64 image is already
 * registered in `$ABOX_TEST_ARM64_HOME` (default `<repo>/.build/arm64-home`); either way the image
 * is rebuilt first when the recipe (images/*.sh) or the guest bundle changed since it was built.
 *
 * Always run (fast): the vz backend's kernel choice (the shipped `Image`, else vmlinuz
 * decompressed once) and the registry's record of `Image` (`files.kernelImage`).
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { execFileSync } from "node:child_process"
import * as crypto from "node:crypto"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import * as zlib from "node:zlib"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { QemuVmmLive } from "../src/layers/QemuVmm.js"
import { goldenOf, imageDigest, listImages, registerImage, resolveImage } from "../src/lib/images.js"
import { KERNEL_IMAGE_FILE } from "../src/domain/sessionLayout.js"
import { SHIPPED_KERNEL_IMAGE, uncompressedKernel } from "../src/vmm/vfkit.js"
import { buildImage } from "../src/programs/image.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import type { GoldenImage } from "../src/domain/image.js"
import { bootSession, guestBundle, repoRoot, runTurn } from "./e2e-vm-image.js"

const home = process.env.ABOX_TEST_ARM64_HOME ?? path.join(repoRoot, ".build", "arm64-home")
const asked = process.env.ABOX_TEST_ARM64 === "1"

const has = (binary: string) => {
  try {
    execFileSync("sh", ["-c", `command -v ${binary}`], { stdio: "ignore" })
    return true
  } catch {
    return false
  }
}

/** the default image of the arm64 home is an aarch64 one (its image.json says so) */
const registered = (): boolean => {
  try {
    const pointer = fs.readFileSync(path.join(home, "images", "default.json"), "utf8")
    const name = /"name":\s*"([^"]+)"/.exec(pointer)?.[1]
    const digest = /"digest":\s*"([0-9a-f]+)"/.exec(pointer)?.[1]
    if (name === undefined || digest === undefined) return false
    const meta = fs.readFileSync(path.join(home, "images", name, digest, "image.json"), "utf8")
    return /"arch":\s*"aarch64"/.test(meta)
  } catch {
    return false
  }
}

const skipReason = (): string | undefined => {
  if (process.platform !== "linux") return "the arm64 boot test runs QEMU on Linux"
  if (!has("qemu-system-aarch64"))
    return "qemu-system-aarch64 is not installed (apt-get install qemu-system-arm)"
  if (!asked && !registered())
    return `no arm64 image in ${home} (set ABOX_TEST_ARM64=1 to build one: needs dpkg --add-architecture arm64)`
  if (!fs.existsSync(guestBundle)) return "dist/ is not built (npm run build)"
  return undefined
}
const reason = skipReason()
if (reason !== undefined) console.warn(`arm64 boot test skipped: ${reason}`)

/** one digest over the recipe (images/*.sh) and the guest bundle: a change means a rebuild */
const recipeInputs = (): string => {
  const hash = crypto.createHash("sha256")
  const imagesDir = path.join(repoRoot, "images")
  const files = [
    guestBundle,
    ...fs
      .readdirSync(imagesDir)
      .filter((name) => name.endsWith(".sh"))
      .sort()
      .map((name) => path.join(imagesDir, name))
  ]
  for (const file of files) hash.update(`${path.basename(file)}\0`).update(fs.readFileSync(file))
  return hash.digest("hex")
}
const stampFile = path.join(home, ".image-inputs")

const arm64Image = Effect.gen(function* () {
  const current = yield* resolveImage(path.join(home, "images"), undefined).pipe(Effect.option)
  const stamp = fs.existsSync(stampFile) ? fs.readFileSync(stampFile, "utf8").trim() : ""
  const inputs = recipeInputs()
  if (
    current._tag === "Some" &&
    current.value.meta.arch === "aarch64" &&
    stamp === `${inputs} ${current.value.meta.digest}`
  )
    return current.value
  const built = yield* buildImage({ arch: "aarch64", variant: "small", agent: guestBundle })
  fs.writeFileSync(stampFile, `${inputs} ${built.meta.digest}\n`)
  return built
}).pipe(
  Effect.provide(
    Layer.mergeAll(aboxPathsAt(home), NodeCommandExecutor.layer.pipe(Layer.provide(NodeFileSystem.layer)))
  )
)

const Live = Layer.mergeAll(
  GuestRpcLive,
  QemuVmmLive({
    arch: "aarch64",
    accel: "tcg",
    helper: [process.execPath, "--import", "tsx", path.join(repoRoot, "src", "vmm", "helper.ts")],
    note: () => undefined
  })
)

describe.skipIf(reason !== undefined)("arm64 image under qemu-system-aarch64 (TCG)", () => {
  it.live(
    "boots to hello, runs a turn on aarch64, powers off on shutdown",
    () =>
      Effect.gen(function* () {
        const registeredImage = yield* arm64Image
        const image: GoldenImage = goldenOf(registeredImage)
        expect(image.arch).toBe("aarch64")
        // the image directory ships the uncompressed kernel vfkit boots, recorded in image.json
        const shipped = registeredImage.meta.files.kernelImage
        expect(shipped?.file).toBe(KERNEL_IMAGE_FILE)
        const shippedPath = path.join(registeredImage.dir, KERNEL_IMAGE_FILE)
        const header = Buffer.alloc(64)
        const fd = fs.openSync(shippedPath, "r")
        fs.readSync(fd, header, 0, 64, 0)
        fs.closeSync(fd)
        // arm64 Image header: magic "ARM\x64" at offset 56 (Linux Documentation/arm64/booting.rst)
        expect(header.subarray(56, 60).toString("latin1")).toBe("ARM\x64")
        expect(fs.statSync(shippedPath).size).toBe(shipped?.size)
        expect(yield* uncompressedKernel(image.kernel, os.tmpdir())).toBe(shippedPath)
        const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-arm64-"))
        execFileSync("cp", ["--reflink=auto", "--sparse=always", image.rootDisk, path.join(dir, "root.raw")])
        const t0 = Date.now()
        const { vm, hello, uname, vsock, helloMs } = yield* Effect.scoped(
          Effect.gen(function* () {
            const { vm, connection } = yield* bootSession(image, dir)
            const helloMs = Date.now() - t0
            const uname = yield* runTurn(connection, "uname -m")
            // what vfkit's vsock RPC channel needs (QEMU here has no vsock device: the turn runs
            // over virtio-serial). A connect to the host (CID 2) with the transport loaded but no
            // device fails with ENODEV in the virtio transport; without vsock.ko it would be
            // EAFNOSUPPORT, without socat "not found".
            const vsock = yield* runTurn(
              connection,
              "cut -d' ' -f1 /proc/modules | grep vsock | sort; socat -V | grep 'socat version'; " +
                "socat -u OPEN:/dev/null VSOCK-CONNECT:2:1024 2>&1 | sed 's/.*): //'"
            )
            return { vm, hello: connection.hello, uname, vsock, helloMs }
          })
        )
        const outcome = yield* vm.outcome
        const totalMs = Date.now() - t0
        console.warn(`arm64 (TCG): hello after ${helloMs} ms, closed after ${totalMs} ms`)
        console.warn(`arm64 guest, vsock check:\n${vsock}`)
        expect(hello.arch).toBe("aarch64")
        expect(uname).toBe("aarch64\n")
        const lines = vsock.trim().split("\n")
        expect(lines.slice(0, 3)).toEqual([
          "vmw_vsock_virtio_transport",
          "vmw_vsock_virtio_transport_common",
          "vsock"
        ])
        expect(lines[3]).toMatch(/^socat version 1\.7\./)
        expect(lines[4]).toBe("No such device")
        expect(outcome.how).toBe("graceful")
        fs.rmSync(dir, { recursive: true, force: true })
      }).pipe(Effect.provide(Live)),
    10 * 60_000
  )
})

describe("the uncompressed kernel for vfkit (Image)", () => {
  const header = (): Buffer => {
    // enough of an arm64 Image for these tests: its magic at offset 56
    const image = Buffer.alloc(8192, 7)
    image.write("ARM\x64", 56, "latin1")
    return image
  }

  it.effect("the vz backend prefers the image's shipped Image to decompressing vmlinuz", () =>
    Effect.gen(function* () {
      expect(SHIPPED_KERNEL_IMAGE).toBe(KERNEL_IMAGE_FILE)
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-kimg-"))
      const session = fs.mkdtempSync(path.join(os.tmpdir(), "abox-kimg-session-"))
      const image = header()
      fs.writeFileSync(path.join(dir, "vmlinuz"), zlib.gzipSync(image))
      fs.writeFileSync(path.join(dir, KERNEL_IMAGE_FILE), image)
      fs.chmodSync(dir, 0o555)
      const chosen = yield* uncompressedKernel(path.join(dir, "vmlinuz"), session)
      expect(chosen).toBe(path.join(dir, KERNEL_IMAGE_FILE))
      // nothing decompressed: neither beside vmlinuz nor into the session
      expect(fs.readdirSync(dir).sort()).toEqual([KERNEL_IMAGE_FILE, "vmlinuz"])
      expect(fs.readdirSync(session)).toEqual([])
      fs.chmodSync(dir, 0o755)
      // a gzipped `Image` (a broken image directory) is not taken: vmlinuz is decompressed instead
      fs.writeFileSync(path.join(dir, KERNEL_IMAGE_FILE), zlib.gzipSync(image))
      const fallback = yield* uncompressedKernel(path.join(dir, "vmlinuz"), session)
      expect(fallback).toBe(path.join(dir, "vmlinuz.Image"))
      expect(fs.readFileSync(fallback).equals(image)).toBe(true)
      fs.rmSync(dir, { recursive: true, force: true })
      fs.rmSync(session, { recursive: true, force: true })
    })
  )

  it.effect("the registry records a shipped Image (read-only, not in the digest); older images decode", () =>
    Effect.gen(function* () {
      const imagesDir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-kimg-reg-"))
      const identity = {
        name: "abox",
        variant: "small" as const,
        arch: "aarch64" as const,
        kernel: "6.1.0-test-arm64",
        node: "20.20.2",
        agent: "b".repeat(64),
        protocol: 4
      }
      const stage = (withImage: boolean, content: string) => {
        const dir = fs.mkdtempSync(path.join(imagesDir, ".build-"))
        fs.writeFileSync(path.join(dir, "vmlinuz"), zlib.gzipSync(header()))
        fs.writeFileSync(path.join(dir, "initrd.gz"), `initrd ${content}`)
        fs.writeFileSync(path.join(dir, "root.raw"), `root ${content}`)
        if (withImage) fs.writeFileSync(path.join(dir, KERNEL_IMAGE_FILE), header())
        return dir
      }
      const sha = (file: string) => crypto.createHash("sha256").update(fs.readFileSync(file)).digest("hex")
      const withImage = yield* registerImage(imagesDir, stage(true, "one"), identity, { makeDefault: true })
      const shipped = path.join(withImage.dir, KERNEL_IMAGE_FILE)
      expect(withImage.meta.files.kernelImage).toEqual({
        file: KERNEL_IMAGE_FILE,
        sha256: sha(shipped),
        size: header().length
      })
      expect(fs.statSync(shipped).mode & 0o777).toBe(0o444)
      const files = withImage.meta.files
      expect(withImage.meta.digest).toBe(
        imageDigest(identity, {
          kernel: files.kernel.sha256,
          initrd: files.initrd.sha256,
          root: files.root.sha256
        })
      )
      const without = yield* registerImage(imagesDir, stage(false, "two"), identity, { makeDefault: false })
      expect(without.meta.files.kernelImage).toBeUndefined()
      // an image.json written before `kernelImage` existed (no such key) is listed as before
      const listed = yield* listImages(imagesDir)
      expect(listed.problems).toEqual([])
      expect(listed.images.map((i) => i.meta.digest).sort()).toEqual(
        [withImage.meta.digest, without.meta.digest].sort()
      )
      const reread = listed.images.find((i) => i.meta.digest === withImage.meta.digest)
      expect(reread?.meta.files.kernelImage?.sha256).toBe(sha(shipped))
      fs.rmSync(imagesDir, { recursive: true, force: true })
    })
  )
})
