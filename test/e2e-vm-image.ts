/**
 * The x86_64 test image, built once and reused across test files and runs:
 * `<repo>/.build/test-home` is an ABOX_HOME whose default image is rebuilt only when its inputs
 * changed: the guest bundle (dist/abox-guest.js, also the image's `agent` digest), the agent's
 * snapshot entry and the recipe (images/*.sh), digested together into `.image-inputs`.
 * Concurrent test files serialise on a lock file.
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { execFileSync } from "node:child_process"
import * as crypto from "node:crypto"
import * as fs from "node:fs"
import { createRequire } from "node:module"
import * as os from "node:os"
import * as path from "node:path"
import * as Chunk from "effect/Chunk"
import * as Stream from "effect/Stream"
import { writeConfigDisk } from "../src/lib/disk.js"
import { goldenOf, listImages, resolveImage } from "../src/lib/images.js"
import { ImagesLive } from "../src/layers/ImagesLive.js"
import { type RegisteredImage } from "../src/domain/image.js"
import type { GuestConfig } from "../src/protocol/GuestConfig.js"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { httpsBrokerLayer } from "../src/broker/HttpsBrokerLive.js"
import { RuntimeLockLive } from "../src/layers/RuntimeLockLive.js"
import { SessionStoreLive } from "../src/layers/SessionStoreLive.js"
import { QemuVmmLive } from "../src/layers/QemuVmm.js"
import { GuestRpc } from "../src/services/GuestRpc.js"
import { type CloseBounds } from "../src/domain/vm.js"
import { VmmBackend } from "../src/services/VmmBackend.js"
import { buildImage } from "../src/programs/image.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import type { GoldenImage } from "../src/domain/image.js"

export { alive, processesMentioning } from "./support/processes.js"

/** what a VM test or benchmark boots with: the real QEMU backend and the host side of the protocol */
export const vmLayer = Layer.mergeAll(
  GuestRpcLive,
  QemuVmmLive({ note: () => undefined }),
  NodeCommandExecutor.layer.pipe(Layer.provide(NodeFileSystem.layer))
)

/**
 * what a whole-session VM test runs on: every live service over `home` (an ABOX_HOME of its own),
 * the real QEMU backend, and a broker that also trusts the test upstream's CA
 */
export const vmSessionLayer = (home: string, upstreamCaPem: string) =>
  Layer.mergeAll(
    SessionStoreLive,
    RuntimeLockLive,
    GuestRpcLive,
    httpsBrokerLayer({ extraUpstreamCa: [upstreamCaPem] }),
    QemuVmmLive({ note: () => undefined }),
    ImagesLive
  ).pipe(
    Layer.provideMerge(aboxPathsAt(home)),
    Layer.provideMerge(NodeCommandExecutor.layer),
    Layer.provideMerge(NodeFileSystem.layer)
  )

export const repoRoot = path.resolve(import.meta.dirname, "..")
export const testHome = path.join(repoRoot, ".build", "test-home")
export const guestBundle = path.join(repoRoot, "dist", "abox-guest.js")
export const guestSnapshotEntry = path.join(repoRoot, "dist", "abox-guest-snapshot.cjs")
export const guestModelBundle = path.join(repoRoot, "dist", "abox-guest-model.cjs")
export const helperBundle = path.join(repoRoot, "dist", "abox-vmm.js")

const has = (binary: string): boolean => {
  try {
    execFileSync("sh", ["-c", `command -v ${binary}`], { stdio: "ignore" })
    return true
  } catch {
    return false
  }
}

/** why the VM tests cannot run here, or undefined when they can */
export const vmSkipReason = (): string | undefined => {
  if (process.platform !== "linux") return "QEMU backend tests run on Linux"
  if (!has("qemu-system-x86_64")) return "qemu-system-x86_64 is not installed"
  if (!fs.existsSync(guestBundle) || !fs.existsSync(helperBundle)) return "dist/ is not built (npm run build)"
  for (const tool of ["mkfs.ext4", "cpio", "dpkg-deb", "apt-get", "npm"]) {
    if (!has(tool)) return `${tool} is missing: the test image cannot be built`
  }
  if (process.getuid?.() !== 0) return "building the image (mkfs.ext4 -d with owners) needs root"
  return undefined
}

const sha256 = (file: string) => crypto.createHash("sha256").update(fs.readFileSync(file)).digest("hex")

/** one digest over everything that goes into the test image from this checkout */
const imageInputs = (): string => {
  const imagesDir = path.join(repoRoot, "images")
  const files = [
    guestBundle,
    ...(fs.existsSync(guestSnapshotEntry) ? [guestSnapshotEntry] : []),
    ...(fs.existsSync(guestModelBundle) ? [guestModelBundle] : []),
    ...fs
      .readdirSync(imagesDir)
      .filter((name) => name.endsWith(".sh"))
      .sort()
      .map((name) => path.join(imagesDir, name))
  ]
  const hash = crypto.createHash("sha256")
  for (const file of files) hash.update(`${path.relative(repoRoot, file)}\0${sha256(file)}\n`)
  return hash.digest("hex")
}

/** the default test image, (re)built when its inputs changed */
export const ensureTestImage = async (): Promise<GoldenImage> => {
  fs.mkdirSync(testHome, { recursive: true })
  const lockFile = path.join(testHome, ".image.lock")
  // a CommonJS native addon without type declarations
  const { waitForLock, unlock } = createRequire(import.meta.url)("fs-native-extensions") as {
    waitForLock: (fd: number) => Promise<boolean>
    unlock: (fd: number) => void
  }
  const fd = fs.openSync(lockFile, "a")
  try {
    await waitForLock(fd)
    const agent = sha256(guestBundle)
    const inputs = imageInputs()
    const stampFile = path.join(testHome, ".image-inputs")
    const stamp = fs.existsSync(stampFile) ? fs.readFileSync(stampFile, "utf8").trim() : ""
    const layer = Layer.mergeAll(
      aboxPathsAt(testHome),
      NodeCommandExecutor.layer.pipe(Layer.provide(NodeFileSystem.layer))
    )
    const program = Effect.gen(function* () {
      const current = yield* resolveImage(path.join(testHome, "images"), undefined).pipe(Effect.option)
      if (
        current._tag === "Some" &&
        current.value.meta.agent === agent &&
        stamp === `${inputs} ${current.value.meta.digest}`
      )
        return goldenOf(current.value)
      const built = yield* buildImage({
        arch: "x86_64",
        variant: "small",
        agent: guestBundle,
        snapshotEntry: guestSnapshotEntry
      })
      fs.writeFileSync(stampFile, `${inputs} ${built.meta.digest}\n`)
      return goldenOf(built)
    })
    return await Effect.runPromise(program.pipe(Effect.provide(layer)))
  } finally {
    unlock(fd)
    fs.closeSync(fd)
  }
}

/**
 * The recipe digest images/build-full.sh writes to `recipe.sha256` beside a workstation image's
 * files: `<name> <sha256>` lines for images/*.sh (C order) and the snapshot entry.
 */
const recipeDigest = (): string => {
  const imagesDir = path.join(repoRoot, "images")
  const lines = fs
    .readdirSync(imagesDir)
    .filter((name) => name.endsWith(".sh"))
    .sort()
    .map((name) => `${name} ${sha256(path.join(imagesDir, name))}\n`)
  if (fs.existsSync(guestSnapshotEntry)) lines.push(`snapshot-entry ${sha256(guestSnapshotEntry)}\n`)
  return crypto.createHash("sha256").update(lines.join("")).digest("hex")
}

/** why the workstation image cannot be built here (debootstrap, a Debian mirror), or undefined */
export const workstationSkipReason = (): string | undefined =>
  vmSkipReason() ??
  (has("debootstrap") ? undefined : "debootstrap is missing: the workstation image cannot be built")

const WORKSTATION = "abox-full"

/**
 * The x86_64 workstation image (`--variant full`), registered in the test home as `abox-full`
 * (not the default: the busybox image stays the fast one). Built once per inputs (the guest
 * bundle, whose digest image.json records, and `recipe.sha256`); a matching image that
 * `scripts/setup.sh` already built in `$ABOX_HOME` (default ~/.abox) is linked in instead of
 * built again (CI runs setup first).
 */
export const ensureWorkstationImage = async (): Promise<GoldenImage> => {
  fs.mkdirSync(testHome, { recursive: true })
  const { waitForLock, unlock } = createRequire(import.meta.url)("fs-native-extensions") as {
    waitForLock: (fd: number) => Promise<boolean>
    unlock: (fd: number) => void
  }
  const fd = fs.openSync(path.join(testHome, ".image.lock"), "a")
  try {
    await waitForLock(fd)
    const agent = sha256(guestBundle)
    const recipe = recipeDigest()
    const matches = (image: RegisteredImage) => {
      const file = path.join(image.dir, "recipe.sha256")
      return (
        image.meta.variant === "full" &&
        image.meta.arch === "x86_64" &&
        image.meta.agent === agent &&
        fs.existsSync(file) &&
        fs.readFileSync(file, "utf8").trim() === recipe
      )
    }
    const layer = Layer.mergeAll(
      aboxPathsAt(testHome),
      NodeCommandExecutor.layer.pipe(Layer.provide(NodeFileSystem.layer))
    )
    const imagesDir = path.join(testHome, "images")
    const program = Effect.gen(function* () {
      const own = (yield* listImages(imagesDir)).images.find((image) => matches(image))
      if (own !== undefined) return goldenOf(own)
      const userHome = process.env.ABOX_HOME ?? path.join(os.homedir(), ".abox")
      const theirs = (yield* listImages(path.join(userHome, "images"))).images.find((image) => matches(image))
      if (theirs !== undefined) {
        // golden files are read-only and never written: a hard link (else a sparse copy) will do
        const target = path.join(imagesDir, theirs.meta.name, theirs.meta.digest)
        const staging = `${target}.link-${process.pid}`
        fs.mkdirSync(staging, { recursive: true })
        for (const file of fs.readdirSync(theirs.dir)) {
          const from = path.join(theirs.dir, file)
          // the golden's own files only: a warm snapshot (warm/) is a cache this home makes itself
          if (!fs.statSync(from).isFile()) continue
          const to = path.join(staging, file)
          try {
            fs.linkSync(from, to)
          } catch {
            execFileSync("cp", ["--sparse=always", "--preserve=mode", from, to])
          }
        }
        fs.rmSync(target, { recursive: true, force: true })
        fs.renameSync(staging, target)
        const linked = (yield* listImages(imagesDir)).images.find((image) => image.dir === target)
        if (linked !== undefined) return goldenOf(linked)
      }
      const built = yield* buildImage({
        arch: "x86_64",
        variant: "full",
        name: WORKSTATION,
        makeDefault: false,
        agent: guestBundle,
        snapshotEntry: guestSnapshotEntry
      })
      return goldenOf(built)
    })
    const image = await Effect.runPromise(program.pipe(Effect.provide(layer)))
    // earlier workstation images of this checkout (other inputs) are 800 MB each: only the current one stays
    const kept = path.dirname(image.kernel)
    const parent = path.join(imagesDir, WORKSTATION)
    for (const digest of fs.existsSync(parent) ? fs.readdirSync(parent) : []) {
      const dir = path.join(parent, digest)
      if (dir !== kept) fs.rmSync(dir, { recursive: true, force: true })
    }
    return image
  } finally {
    unlock(fd)
    fs.closeSync(fd)
  }
}

export const bootSession = (
  image: GoldenImage,
  dir: string,
  config: Partial<GuestConfig> = {},
  bounds: CloseBounds = { graceful: "15 seconds", signalled: "5 seconds", killed: "5 seconds" },
  shutdownTimeout: Duration.DurationInput = "15 seconds"
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
      shutdownTimeout
    })
    const vm = yield* vmm.start({
      sessionId: id,
      sessionDir: dir,
      arch: image.arch,
      kernel: image.kernel,
      initrd: image.initrd,
      // the session's root disk: an overlay of the golden where the directory has one
      ...(fs.existsSync(path.join(dir, "root.qcow2"))
        ? { rootDisk: path.join(dir, "root.qcow2"), rootDiskFormat: "qcow2" as const }
        : { rootDisk: path.join(dir, "root.raw") }),
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
