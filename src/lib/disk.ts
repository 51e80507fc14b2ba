import * as Command from "@effect/platform/Command"
import type * as CommandExecutor from "@effect/platform/CommandExecutor"
import * as Effect from "effect/Effect"
import * as crypto from "node:crypto"
// Raw node:fs: copyFile with COPYFILE_FICLONE_FORCE (reflink or nothing), statfs for free
// space and chmod/rename of the clone are not exposed by @effect/platform's FileSystem.
import * as fs from "node:fs/promises"
import { constants as fsConstants } from "node:fs"
import * as path from "node:path"
import { encodeConfigDisk } from "../protocol/ConfigDisk.js"
import type { GuestConfig } from "../protocol/GuestConfig.js"
import { DiskError } from "../domain/image.js"
import { removeTemp, writeFileAtomic } from "./atomicFile.js"
import { errorMessage } from "../domain/errorMessage.js"

export type CloneMethod = "reflink" | "sparse-copy"

export interface CloneResult {
  readonly method: CloneMethod
  /** bytes the clone occupies on disk right after the copy (st_blocks × 512) */
  readonly allocated: number
}

const io = <A>(file: string, reason: string, run: () => Promise<A>) =>
  Effect.tryPromise({
    try: run,
    catch: (cause) =>
      new DiskError({ path: file, reason, message: `${reason} ${file}: ${errorMessage(cause)}` })
  })

/**
 * Every disk abox makes is a whole number of MiB: Virtualization.framework refuses an image whose
 * size is not a multiple of 512 bytes ("The disk image format is not recognized"), and 1 MiB
 * also suits every VMM's and file system's larger sector and cluster sizes.
 */
export const DISK_SIZE_ALIGN = 1024 * 1024

/** `bytes` rounded up to a whole number of DISK_SIZE_ALIGN */
export const alignDiskSize = (bytes: number): number => Math.ceil(bytes / DISK_SIZE_ALIGN) * DISK_SIZE_ALIGN

/** free-space margin kept on top of what a copy needs: 64 MiB or 5 % of the image, whichever is larger */
export const spaceMargin = (allocated: number): number =>
  Math.max(64 * 1024 * 1024, Math.ceil(allocated * 0.05))

/**
 * Fails with `DiskError(reason "no-space")` unless the filesystem holding `dir` has room for
 * `needed` bytes plus the margin: a clear error rather than a full disk halfway through a copy.
 */
export const checkFreeSpace = Effect.fn("disk.checkFreeSpace")(function* (dir: string, needed: number) {
  const stats = yield* io(dir, "statfs", () => fs.statfs(dir))
  const available = stats.bavail * stats.bsize
  const wanted = needed + spaceMargin(needed)
  if (available < wanted) {
    const mib = (n: number) => `${Math.ceil(n / (1024 * 1024))} MiB`
    return yield* new DiskError({
      path: dir,
      reason: "no-space",
      message: `not enough free space in ${dir}: the disk copy needs ${mib(wanted)} (with margin), ${mib(available)} available`
    })
  }
  return available
})

const isNoReflink = (cause: unknown): boolean => {
  const code = typeof cause === "object" && cause !== null && "code" in cause ? String(cause.code) : ""
  return ["ENOTSUP", "EOPNOTSUPP", "EXDEV", "EINVAL", "ENOSYS", "ENOTTY", "EBADF", "EPERM"].includes(code)
}

/** a temporary name beside `target`, renamed into place when the file is whole */
const tempBeside = (target: string): string =>
  path.join(path.dirname(target), `.${path.basename(target)}.tmp-${crypto.randomBytes(6).toString("hex")}`)

/** an O(1) reflink of `source` at `temp`: true, or false where the filesystem has none (temp removed) */
const reflinkTo = (source: string, temp: string, target: string) =>
  Effect.tryPromise({
    try: () => fs.copyFile(source, temp, fsConstants.COPYFILE_FICLONE_FORCE),
    catch: (cause) => cause
  }).pipe(
    Effect.as(true),
    Effect.catchAll((cause) => {
      const cleanup = removeTemp(temp)
      return isNoReflink(cause)
        ? cleanup.pipe(Effect.as(false))
        : cleanup.pipe(
            Effect.zipRight(
              Effect.fail(
                new DiskError({
                  path: target,
                  reason: "clone",
                  message: `reflink ${source} → ${target}: ${errorMessage(cause)}`
                })
              )
            )
          )
    })
  )

/**
 * An O(1) reflink (clonefile) of `source` at `target` (mode 0600), or false where the filesystem
 * cannot make one (nothing is left behind then).
 */
export const reflinkDisk = Effect.fn("disk.reflinkDisk")(function* (source: string, target: string) {
  const temp = tempBeside(target)
  const cleanup = removeTemp(temp)
  if (!(yield* reflinkTo(source, temp, target))) return false
  yield* io(temp, "chmod", () => fs.chmod(temp, 0o600)).pipe(Effect.tapError(() => cleanup))
  yield* io(target, "rename", () => fs.rename(temp, target)).pipe(Effect.tapError(() => cleanup))
  return true
})

/**
 * Clone a golden disk to `target` (mode 0600): an O(1) reflink where the filesystem has one
 * (btrfs, xfs, APFS), else a sparse-aware copy (`cp --reflink=auto --sparse=always` on Linux,
 * `cp -c` on macOS) after a free-space check. Never Node's COPYFILE_FICLONE fallback, which
 * fills holes. The clone is made under a temporary name and renamed into place.
 */
export const cloneDisk = Effect.fn("disk.cloneDisk")(function* (source: string, target: string) {
  const sourceStat = yield* io(source, "stat", () => fs.stat(source))
  const temp = tempBeside(target)
  const cleanup = removeTemp(temp)
  const reflinked = yield* reflinkTo(source, temp, target)
  let method: CloneMethod = "reflink"
  if (!reflinked) {
    method = "sparse-copy"
    yield* checkFreeSpace(path.dirname(target), sourceStat.blocks * 512)
    const command =
      process.platform === "darwin"
        ? Command.make("cp", "-c", source, temp)
        : Command.make("cp", "--reflink=auto", "--sparse=always", source, temp)
    const exit = yield* Command.exitCode(
      command.pipe(Command.stdout("inherit"), Command.stderr("inherit"))
    ).pipe(
      Effect.mapError(
        (error) => new DiskError({ path: target, reason: "clone", message: `cp: ${errorMessage(error)}` })
      )
    )
    if (exit !== 0) {
      yield* cleanup
      return yield* new DiskError({
        path: target,
        reason: "clone",
        message: `cp ${source} → ${target} exited ${exit}`
      })
    }
  }
  // a golden of an odd size (an older build, a --root-size in bytes) is grown to a whole MiB: the
  // file system inside does not mind a larger device, and vfkit refuses the odd size
  const copied = yield* io(temp, "stat", () => fs.stat(temp)).pipe(Effect.tapError(() => cleanup))
  if (copied.size % DISK_SIZE_ALIGN !== 0) {
    yield* io(temp, "truncate", () => fs.truncate(temp, alignDiskSize(copied.size))).pipe(
      Effect.tapError(() => cleanup)
    )
  }
  yield* io(temp, "chmod", () => fs.chmod(temp, 0o600)).pipe(Effect.tapError(() => cleanup))
  yield* io(target, "rename", () => fs.rename(temp, target)).pipe(Effect.tapError(() => cleanup))
  const after = yield* io(target, "stat", () => fs.stat(target))
  return { method, allocated: after.blocks * 512 } satisfies CloneResult
})

/** `config.raw`: the sealed, secretless config disk, written atomically with mode 0600 */
export const writeConfigDisk = Effect.fn("disk.writeConfigDisk")(function* (
  file: string,
  config: GuestConfig
) {
  yield* writeFileAtomic(file, encodeConfigDisk(config), 0o600).pipe(
    Effect.mapError((error) => new DiskError({ path: file, reason: "write", message: error.message }))
  )
})

export type DiskRequirements = CommandExecutor.CommandExecutor
