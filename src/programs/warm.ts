/**
 * Warm open (docs/on-disk.md "Warm snapshots"): an image's golden, booted once with its agent
 * waiting for a session, saved; Open restores it (≈ 1 s under TCG against a 5 s boot) and hands
 * the session over the protocol. The snapshot is made lazily by the first Open that needs it
 * (or ahead, `abox image warm`), content-addressed by what makes it restorable; where one cannot
 * be used, Open cold-boots and says why at `--log-level debug`.
 *
 * No session exists when it is made: no config, no broker, no credential is in that VM (only the
 * golden's files and a guest waiting), so no state file holds a secret.
 */
import * as Config from "effect/Config"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as crypto from "node:crypto"
// Raw node:fs: a small manifest, a state file's size, renames of a finished snapshot directory.
import * as fs from "node:fs/promises"
import * as path from "node:path"
import { DiskError, type GoldenImage } from "../domain/image.js"
import { WARM_DIR, WARM_FILES } from "../domain/sessionLayout.js"
import type { WarmInputs } from "../domain/warm.js"
import { type StateCompression, StateManifest } from "../domain/memoryState.js"
import { writeJsonAtomic } from "../lib/atomicFile.js"
import { errorMessage } from "../domain/errorMessage.js"
import { createOverlay, qemuImgTool } from "../lib/rootDisk.js"
import { VmmBackend } from "../services/VmmBackend.js"
import { Images } from "../services/Images.js"
import { VmmUnavailable } from "../domain/vm.js"
import { defaultCompression, diskBytes, readManifest } from "../vmm/migration.js"

/** a warm snapshot's directory name: a hash of what its state only fits */
export const warmKey = (inputs: WarmInputs): string =>
  crypto
    .createHash("sha256")
    .update(
      JSON.stringify([inputs.imageDigest, inputs.qemuVersion, inputs.layoutDigest, inputs.cpus, inputs.memoryMiB])
    )
    .digest("hex")
    .slice(0, 32)

/**
 * How a warm state is stored (`ABOX_WARM_STATE`: zstd or raw; default raw): read at every warm
 * Open, it is loaded fastest as the raw stream, where zstd trades its decompression (≈ 0.15 s
 * more per Open under TCG here, docs/on-disk.md) for a third of the disk.
 */
export const warmCompression = Config.literal("zstd", "raw")("ABOX_WARM_STATE").pipe(
  Config.withDefault("raw" as StateCompression),
  Effect.orElseSucceed(() => defaultCompression())
)

export type WarmChoice =
  | {
      readonly _tag: "Warm"
      readonly dir: string
      readonly state: string
      readonly root: string
      readonly built: boolean
      readonly manifest: StateManifest
    }
  | { readonly _tag: "Cold"; readonly reason: string }

const cold = (reason: string): WarmChoice => ({ _tag: "Cold", reason })

/** `ABOX_WARM=0` (or false) turns warm open off; on by default */
export const warmEnabled = Config.boolean("ABOX_WARM").pipe(
  Config.withDefault(true),
  Effect.orElseSucceed(() => true)
)

/** `images/<name>/<digest>/warm`, beside the golden's root.raw */
export const warmRoot = (image: Pick<GoldenImage, "rootDisk">): string =>
  path.join(path.dirname(image.rootDisk), WARM_DIR)

const io = <A>(file: string, reason: string, run: () => Promise<A>) =>
  Effect.tryPromise({
    try: run,
    catch: (cause) =>
      new DiskError({ path: file, reason, message: `${reason} ${file}: ${errorMessage(cause)}` })
  })

/**
 * Makes the snapshot under a temporary directory, renamed into place whole (a
 * concurrent Open that finished first wins; ours is dropped).
 */
const build = Effect.fn("warm.build")(function* (
  image: GoldenImage,
  target: string,
  inputs: WarmInputs
) {
  const vmm = yield* VmmBackend
  const warm = vmm.warm!
  const parent = path.dirname(target)
  const work = path.join(parent, `.${crypto.randomBytes(6).toString("hex")}.building`)
  yield* io(work, "mkdir", () => fs.mkdir(work, { recursive: true, mode: 0o700 }))
  const cleanup = Effect.promise(() => fs.rm(work, { recursive: true, force: true }))
  return yield* Effect.gen(function* () {
    const root = path.join(work, WARM_FILES.root)
    const state = path.join(work, WARM_FILES.state)
    // the backing file by its real path: every session's copy of this overlay names it, whatever
    // home (or symlink to an images directory) made the snapshot
    const golden = yield* io(image.rootDisk, "realpath", () => fs.realpath(image.rootDisk))
    yield* createOverlay(yield* qemuImgTool, golden, root)
    const manifest = yield* warm.build({
      workDir: work,
      kernel: image.kernel,
      initrd: image.initrd,
      rootDisk: root,
      cpus: inputs.cpus,
      memoryMiB: inputs.memoryMiB,
      stateFile: state,
      imageDigest: inputs.imageDigest,
      compression: yield* warmCompression
    })
    const manifestFile = path.join(work, WARM_FILES.manifest)
    yield* writeJsonAtomic(manifestFile, StateManifest, manifest).pipe(
      Effect.mapError(
        (e) => new DiskError({ path: manifestFile, reason: "write", message: `write ${manifestFile}: ${e.message}` })
      )
    )
    yield* Effect.promise(() =>
      Promise.all(["rpc.sock", "qmp.sock"].map((file) => fs.rm(path.join(work, file), { force: true })))
    )
    yield* io(target, "rename", () => fs.rename(work, target)).pipe(
      // another Open made the same snapshot meanwhile: keep theirs
      Effect.catchAll((error) =>
        Effect.promise(() =>
          fs.access(path.join(target, WARM_FILES.manifest)).then(
            () => true,
            () => false
          )
        ).pipe(Effect.flatMap((present) => (present ? cleanup : Effect.fail(error))))
      )
    )
  }).pipe(Effect.onError(() => cleanup))
})

/**
 * The warm snapshot this Open can restore, made now if there is none yet; or why it boots cold
 * (told at debug level by the caller). Never fails: every problem is a reason to boot.
 */
export const warmSnapshotFor = Effect.fn("warm.snapshotFor")(function* (
  image: GoldenImage,
  resources: { readonly cpus: number; readonly memoryMiB: number },
  options: { readonly enabled?: boolean | undefined; readonly build?: boolean | undefined } = {}
) {
  const vmm = yield* VmmBackend
  if (options.enabled === false || !(yield* warmEnabled)) return cold("warm open is off (ABOX_WARM)")
  if (vmm.warm === undefined) return cold(`the ${vmm.name} backend cannot restore a VM's memory`)
  const inputs = yield* Effect.either(vmm.warm.inputs({ digest: image.identity.digest }, resources))
  if (Either.isLeft(inputs)) return cold(`no warm snapshot here: ${inputs.left.message}`)
  const key = warmKey(inputs.right)
  const dir = path.join(warmRoot(image), key)
  const manifestFile = path.join(dir, WARM_FILES.manifest)
  const state = path.join(dir, WARM_FILES.state)
  const root = path.join(dir, WARM_FILES.root)
  const present = () =>
    fs.access(manifestFile).then(
      () => true,
      () => false
    )
  let built = false
  if (!(yield* Effect.promise(present))) {
    if (options.build === false) return cold(`image ${image.identity.name} has no warm snapshot for ${key}`)
    const made = yield* Effect.either(build(image, dir, inputs.right))
    if (Either.isLeft(made)) return cold(`the warm snapshot could not be made: ${made.left.message}`)
    built = true
  }
  const manifest = yield* Effect.either(readManifest(manifestFile))
  if (Either.isLeft(manifest)) return cold(`${manifest.left.message} (left as it is)`)
  const size = yield* Effect.sync(() => {
    try {
      return diskBytes(state)
    } catch {
      return -1
    }
  })
  if (size !== manifest.right.bytes) {
    return cold(
      `the warm state ${state} is ${size < 0 ? "missing" : `${size} bytes, not ${manifest.right.bytes}`}`
    )
  }
  // whether it fits this VM (QEMU, layout, memory, CPUs, image) is the restore's check
  return { _tag: "Warm", dir, state, root, built, manifest: manifest.right } satisfies WarmChoice
})

/**
 * The warm snapshots an image has (`abox image list`): how many, and the bytes their files
 * occupy (state, root overlay, manifest), unfinished builds included (they are the image's too).
 */
export const warmUsage = Effect.fn("warm.usage")(function* (image: Pick<GoldenImage, "rootDisk">) {
  const dir = warmRoot(image)
  return yield* Effect.promise(async () => {
    const entries = await fs.readdir(dir).catch(() => [] as Array<string>)
    let bytes = 0
    let snapshots = 0
    for (const entry of entries) {
      const files = await fs.readdir(path.join(dir, entry)).catch(() => [] as Array<string>)
      if (!entry.startsWith(".") && files.includes(WARM_FILES.manifest)) snapshots += 1
      for (const file of files) {
        bytes += await fs.stat(path.join(dir, entry, file)).then(
          (s) => s.blocks * 512,
          () => 0
        )
      }
    }
    return { snapshots, bytes }
  })
})

/**
 * `abox image warm [ref]`: the image's warm snapshot for these resources made now (or found),
 * so that no Open pays for it; VmmUnavailable with the reason where there can be none.
 */
export const warmImage = Effect.fn("warm.image")(function* (
  ref: string | undefined,
  resources: { readonly cpus: number; readonly memoryMiB: number }
) {
  const images = yield* Images
  const vmm = yield* VmmBackend
  const image = yield* images.resolve(ref)
  const choice = yield* warmSnapshotFor(image, resources)
  if (choice._tag === "Cold") return yield* new VmmUnavailable({ backend: vmm.name, message: choice.reason })
  return { image, ...choice }
})
