/**
 * A session's root disk (/dev/vda; docs/on-disk.md "The root disk"). A session costs what it
 * changed, not a copy of the golden image:
 *
 * - where the filesystem reflinks (btrfs, XFS, APFS): `root.raw`, an O(1) clone of the golden;
 * - else, on QEMU: `root.qcow2`, a qcow2 overlay whose backing file is the golden's `root.raw`
 *   by its absolute path (content-addressed and read-only under `images/<name>/<digest>/`, so it
 *   never changes under a session; `abox image rm` refuses, or first makes the session
 *   standalone);
 * - else (vfkit attaches raw disks only): `root.raw`, a sparse-aware copy.
 *
 * Crash safety: overlays are made with `lazy_refcounts=off` (QEMU's default, written out), so a
 * VM killed mid-write leaves at worst leaked clusters; resume runs `qemu-img check -r leaks`,
 * which reclaims them and refuses a corrupt overlay with a typed error (DiskError "corrupt").
 */
import * as Effect from "effect/Effect"
import * as crypto from "node:crypto"
// Raw node:fs: copies, fsync and renames of the standalone files; stat for sizes.
import * as fs from "node:fs/promises"
import * as path from "node:path"
import { DiskError, type GoldenImage, ImageJson } from "../domain/image.js"
import type { RootDiskInfo } from "../domain/session.js"
import { IMAGE_FILES, IMAGE_META_FILE, sessionFile } from "../domain/sessionLayout.js"
import { readFileSync, statSync } from "node:fs"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import type { DiskFormat } from "../domain/vm.js"
import { errorMessage } from "../domain/errorMessage.js"
import { checkFreeSpace, cloneDisk, reflinkDisk } from "./disk.js"
import { findTool, runTool } from "./repoDisk.js"

export interface RootDisk {
  readonly file: string
  readonly info: RootDiskInfo
}

const io = <A>(file: string, reason: string, run: () => Promise<A>) =>
  Effect.tryPromise({
    try: run,
    catch: (cause) =>
      new DiskError({ path: file, reason, message: `${reason} ${file}: ${errorMessage(cause)}` })
  })

const exists = (file: string) =>
  Effect.promise(() =>
    fs.access(file).then(
      () => true,
      () => false
    )
  )

/** `qemu-img` on PATH or in the sbin directories, or a DiskError naming what is missing */
export const qemuImgTool = Effect.flatMap(findTool("qemu-img"), (found) =>
  found === undefined
    ? Effect.fail(new DiskError({ path: "qemu-img", reason: "tool", message: "qemu-img is not installed" }))
    : Effect.succeed(found)
)

const temporary = (target: string): string =>
  path.join(path.dirname(target), `.${path.basename(target)}.tmp-${crypto.randomBytes(6).toString("hex")}`)

/**
 * `root.qcow2` over `golden` (absolute path; raw, or qcow2 for an environment image's overlay),
 * mode 0600, made under a temporary name
 */
export const createOverlay = Effect.fn("rootDisk.createOverlay")(function* (
  qemuImg: string,
  golden: string,
  target: string,
  backingFormat: DiskFormat = "raw"
) {
  const temp = temporary(target)
  const cleanup = Effect.promise(() => fs.rm(temp, { force: true }))
  yield* runTool(target, qemuImg, [
    "create",
    "-q",
    "-f",
    "qcow2",
    "-F",
    backingFormat,
    "-b",
    path.resolve(golden),
    "-o",
    "lazy_refcounts=off",
    temp
  ]).pipe(Effect.tapError(() => cleanup))
  yield* io(temp, "chmod", () => fs.chmod(temp, 0o600)).pipe(Effect.tapError(() => cleanup))
  yield* io(target, "rename", () => fs.rename(temp, target)).pipe(Effect.tapError(() => cleanup))
})

/**
 * The root disk of a new session in `dir`: a reflink where the filesystem has one; else, when
 * the backend attaches qcow2 (`overlay`), an overlay of the golden; else a sparse copy.
 */
export const makeRootDisk = Effect.fn("rootDisk.make")(function* (
  image: Pick<GoldenImage, "rootDisk" | "identity" | "rootFormat">,
  dir: string,
  overlay: boolean
) {
  const raw = sessionFile(dir, "rootDisk")
  const backing = image.identity.digest
  if (image.rootFormat === "qcow2") {
    // an environment image: its root is an overlay itself, so a session's is one over it
    if (!overlay) {
      return yield* new DiskError({
        path: image.rootDisk,
        reason: "format",
        message: `${image.identity.name} is an environment image (a qcow2 overlay): this VMM backend boots raw root disks only`
      })
    }
    const file = sessionFile(dir, "rootQcow2")
    yield* createOverlay(yield* qemuImgTool, image.rootDisk, file, "qcow2")
    return { file, info: { format: "qcow2", kind: "overlay", backing } } satisfies RootDisk
  }
  if (overlay) {
    if (yield* reflinkDisk(image.rootDisk, raw)) {
      return { file: raw, info: { format: "raw", kind: "reflink", backing } } satisfies RootDisk
    }
    const qemuImg = yield* findTool("qemu-img")
    if (qemuImg !== undefined) {
      const file = sessionFile(dir, "rootQcow2")
      yield* createOverlay(qemuImg, image.rootDisk, file)
      return { file, info: { format: "qcow2", kind: "overlay", backing } } satisfies RootDisk
    }
  }
  const cloned = yield* cloneDisk(image.rootDisk, raw)
  return {
    file: raw,
    info: { format: "raw", kind: cloned.method === "reflink" ? "reflink" : "copy", backing }
  } satisfies RootDisk
})

/** the root disk a session boots: what session.json records, else (older sessions) root.raw */
export const sessionRootDisk = (
  dir: string,
  recorded: RootDiskInfo | undefined
): { readonly file: string; readonly format: DiskFormat } =>
  recorded?.format === "qcow2"
    ? { file: sessionFile(dir, "rootQcow2"), format: "qcow2" }
    : { file: sessionFile(dir, "rootDisk"), format: "raw" }

/**
 * The bytes a session shares with others: what its image's golden root.raw occupies, when the
 * session's root disk is an overlay of it (0 otherwise, or when the image is gone). Synchronous:
 * `abox list` reads every session in one pass.
 */
export const sharedBytesSync = (
  imagesDir: string,
  image: { readonly name: string; readonly digest: string } | undefined,
  recorded: RootDiskInfo | undefined
): number => (image === undefined || recorded?.kind !== "overlay" ? 0 : imageRootBytes(imagesDir, image, 0))

const decodeImageJson = Schema.decodeUnknownOption(Schema.parseJson(ImageJson))

/**
 * What an image's root occupies: its root.raw, or for an environment image its overlay (the file
 * its image.json names) and its base's root under it, as a session of it shares both. 0 when a
 * file is gone or the record does not read (a chain is a few images deep; more is not ours).
 */
const imageRootBytes = (
  imagesDir: string,
  image: { readonly name: string; readonly digest: string },
  depth: number
): number => {
  const dir = path.join(imagesDir, image.name, image.digest)
  const blocks = (file: string) => {
    try {
      return statSync(path.join(dir, file)).blocks * 512
    } catch {
      return undefined
    }
  }
  const raw = blocks(IMAGE_FILES.root)
  if (raw !== undefined) return raw
  if (depth >= 4) return 0
  let text: string
  try {
    text = readFileSync(path.join(dir, IMAGE_META_FILE), "utf8")
  } catch {
    return 0
  }
  const meta = decodeImageJson(text)
  if (Option.isNone(meta) || meta.value.environment === undefined) return 0
  const overlay = blocks(path.basename(meta.value.files.root.file)) ?? 0
  return overlay + imageRootBytes(imagesDir, meta.value.environment.base, depth + 1)
}

/** how `abox list`/`show` name a session's root disk */
export const describeRootDisk = (recorded: RootDiskInfo | undefined): string => {
  switch (recorded?.kind) {
    case undefined:
      return "root.raw (full copy, made before overlays)"
    case "overlay":
      return "root.qcow2 (overlay of the image)"
    case "reflink":
      return "root.raw (reflink of the image)"
    case "copy":
      return "root.raw (full copy)"
    case "standalone":
      return "root.qcow2 (standalone)"
  }
}

/**
 * Before a qcow2 root boots: `qemu-img check -r leaks` reclaims the clusters a killed VM leaked
 * and fails `DiskError` (reason "corrupt") on corruption, which it never repairs silently.
 * Exit codes (qemu-img(1)): 0 clean, 1 the check could not run, 2 corruption, 3 leaks left.
 */
export const checkOverlay = Effect.fn("rootDisk.check")(function* (file: string) {
  const qemuImg = yield* qemuImgTool
  yield* runTool(file, qemuImg, ["check", "-q", "-r", "leaks", "-f", "qcow2", file]).pipe(
    Effect.catchAll((error) =>
      Effect.fail(
        new DiskError({
          path: file,
          reason: "corrupt",
          message: `the root disk ${file} does not pass \`qemu-img check\` (left as it is): ${error.message}`
        })
      )
    )
  )
})

/**
 * The standalone files a session boots from when its image is gone: `vmlinuz`, `initrd.gz`
 * (and `Image` where there is one) in the session directory.
 */
export const standaloneKernel = (dir: string) =>
  Effect.gen(function* () {
    const kernel = sessionFile(dir, "kernel")
    const initrd = sessionFile(dir, "initrd")
    return (yield* exists(kernel)) && (yield* exists(initrd)) ? { kernel, initrd } : undefined
  })

const fsync = (file: string) =>
  io(file, "fsync", async () => {
    const handle = await fs.open(file, "r")
    try {
      await handle.sync()
    } finally {
      await handle.close()
    }
  })

/** `source` copied to `target` through a temporary name, synced, renamed (0600) */
const copyInto = (source: string, target: string) =>
  Effect.gen(function* () {
    const temp = temporary(target)
    const cleanup = Effect.promise(() => fs.rm(temp, { force: true }))
    yield* io(target, "copy", () => fs.copyFile(source, temp)).pipe(Effect.tapError(() => cleanup))
    yield* io(temp, "chmod", () => fs.chmod(temp, 0o600)).pipe(Effect.tapError(() => cleanup))
    yield* fsync(temp).pipe(Effect.tapError(() => cleanup))
    yield* io(target, "rename", () => fs.rename(temp, target)).pipe(Effect.tapError(() => cleanup))
  })

/**
 * The root disk of a session restored from a warm snapshot: a copy of the snapshot's overlay
 * (the disk its guest had mounted; the guest's memory and that disk must agree), which is an
 * overlay of the golden like any other (the same backing file), so resume, gc and `image rm`
 * treat the session as they treat one that booted.
 */
export const copyWarmRoot = Effect.fn("rootDisk.copyWarm")(function* (
  image: Pick<GoldenImage, "identity">,
  warmRootDisk: string,
  dir: string
) {
  const file = sessionFile(dir, "rootQcow2")
  yield* copyInto(warmRootDisk, file)
  return {
    file,
    info: { format: "qcow2", kind: "overlay", backing: image.identity.digest }
  } satisfies RootDisk
})

/**
 * Makes a session independent of its image (`abox image rm --force`), each step atomic so that
 * a crash at any point leaves it bootable: the kernel and initrd are copied beside it first
 * (resume prefers them; they are the image's own bytes), then an overlay is flattened into a
 * standalone qcow2 under a temporary name (`qemu-img convert`) and renamed over root.qcow2.
 * The caller then records `kind: "standalone"` in session.json. A raw root is whole already.
 */
export const makeStandalone = Effect.fn("rootDisk.makeStandalone")(function* (
  image: Pick<GoldenImage, "kernel" | "initrd" | "rootDisk">,
  dir: string,
  recorded: RootDiskInfo | undefined,
  /** test hook: runs between the steps, so a test can stop the work where a crash would */
  between: (step: "kernel" | "disk") => Effect.Effect<void> = () => Effect.void
) {
  yield* copyInto(image.kernel, sessionFile(dir, "kernel"))
  const kernelImage = path.join(path.dirname(image.kernel), "Image")
  if (yield* exists(kernelImage)) yield* copyInto(kernelImage, sessionFile(dir, "kernelImage"))
  yield* copyInto(image.initrd, sessionFile(dir, "initrd"))
  yield* between("kernel")
  const root = sessionRootDisk(dir, recorded)
  if (root.format === "qcow2" && recorded?.kind !== "standalone") {
    const qemuImg = yield* qemuImgTool
    // the flattened disk holds the golden's data and the session's changes
    const golden = yield* io(image.rootDisk, "stat", () => fs.stat(image.rootDisk))
    const own = yield* io(root.file, "stat", () => fs.stat(root.file))
    yield* checkFreeSpace(dir, golden.blocks * 512 + own.blocks * 512)
    const temp = temporary(root.file)
    const cleanup = Effect.promise(() => fs.rm(temp, { force: true }))
    yield* runTool(root.file, qemuImg, ["convert", "-q", "-f", "qcow2", "-O", "qcow2", root.file, temp]).pipe(
      Effect.tapError(() => cleanup)
    )
    yield* io(temp, "chmod", () => fs.chmod(temp, 0o600)).pipe(Effect.tapError(() => cleanup))
    yield* fsync(temp).pipe(Effect.tapError(() => cleanup))
    yield* between("disk")
    yield* io(root.file, "rename", () => fs.rename(temp, root.file)).pipe(Effect.tapError(() => cleanup))
  }
})
