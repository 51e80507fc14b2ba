/**
 * Frozen layers (docs/on-disk.md "Forks and frozen layers"): a fork turns a session's writable
 * qcow2 disks (`root.qcow2`, `repo.qcow2`) into read-only layers `root.frozen-<n>.qcow2` /
 * `repo.frozen-<n>.qcow2` in the same directory, and both the session and its fork go on in new
 * overlays over them. Backing files are named by absolute path, as a session's root names its
 * golden.
 *
 * Each step leaves a bootable session: the frozen name is a hard link to the disk being written
 * (one inode, two names) and the new overlay is made over it. A stopped session's overlay is
 * made under a temporary name and renamed over the active name. A running VM's QEMU opens the
 * files again by the names it has (a migration's end does), so nothing it opened is renamed
 * while it runs: its new overlay is `root.next-<n>.qcow2`, which `settleDisks` renames over
 * `root.qcow2` once the VM is down (before any boot, by the session's lock holder). A crash in
 * between leaves at most an unused frozen link, which `abox gc` removes.
 */
import * as Effect from "effect/Effect"
import * as Schema from "effect/Schema"
import * as crypto from "node:crypto"
// Raw node:fs: links, renames and directory reads of a session's disks.
import * as fs from "node:fs/promises"
import * as path from "node:path"
import { DiskError } from "../domain/image.js"
import { errorMessage } from "../domain/errorMessage.js"
import { sessionFile } from "../domain/sessionLayout.js"
import { runTool } from "./repoDisk.js"

export type FrozenDrive = "root" | "repo"

/** `root.frozen-<n>.qcow2` / `repo.frozen-<n>.qcow2` */
export const frozenName = (drive: FrozenDrive, n: number): string => `${drive}.frozen-${n}.qcow2`

const FROZEN = /^(root|repo)\.frozen-(\d+)\.qcow2$/
const NEXT = /^(root|repo)\.next-(\d+)\.qcow2$/

/** `root.next-<n>.qcow2`: the overlay a running VM went on in after a fork, until it is down */
export const nextName = (drive: FrozenDrive, n: number): string => `${drive}.next-${n}.qcow2`

/** is this file name a frozen layer's */
export const isFrozenName = (name: string): boolean => FROZEN.test(name)

/** the active (writable) disk of `drive` in a session directory */
export const activeDisk = (dir: string, drive: FrozenDrive): string =>
  sessionFile(dir, drive === "root" ? "rootQcow2" : "repoQcow2")

/** a fallible file operation as a DiskError naming the file */
export const io = <A>(file: string, reason: string, run: () => Promise<A>) =>
  Effect.tryPromise({
    try: run,
    catch: (cause) =>
      new DiskError({ path: file, reason, message: `${reason} ${file}: ${errorMessage(cause)}`, cause })
  })

export const exists = (file: string) =>
  Effect.promise(() =>
    fs.access(file).then(
      () => true,
      () => false
    )
  )

/** the frozen layers a session directory holds, by file name */
export const frozenLayersIn = (dir: string): Effect.Effect<ReadonlyArray<string>> =>
  Effect.promise(() => fs.readdir(dir).catch(() => [] as Array<string>)).pipe(
    Effect.map((names) => names.filter(isFrozenName).sort())
  )

/** the next unused layer number in `dir` (one number per fork, for both drives) */
export const nextFrozenIndex = (dir: string): Effect.Effect<number> =>
  Effect.map(
    frozenLayersIn(dir),
    (names) => names.reduce((max, name) => Math.max(max, Number(FROZEN.exec(name)?.[2] ?? 0)), 0) + 1
  )

/** a temporary name beside `target` */
export const temporaryBeside = (target: string): string =>
  path.join(path.dirname(target), `.${path.basename(target)}.tmp-${crypto.randomBytes(6).toString("hex")}`)

/** a qcow2 overlay at `target` over the qcow2 `backing` (absolute path), 0600 */
export const createQcow2Overlay = (qemuImg: string, backing: string, target: string) =>
  Effect.gen(function* () {
    // -U: the backing may be held by a running VM (its write lock)
    const info = yield* runTool(backing, qemuImg, ["info", "-U", "--output=json", "-f", "qcow2", backing])
    const size = yield* Schema.decodeUnknown(
      Schema.parseJson(Schema.Struct({ "virtual-size": Schema.Number }))
    )(info).pipe(
      Effect.mapError(
        (cause) =>
          new DiskError({
            path: backing,
            reason: "tool",
            message: `qemu-img info ${backing}: ${cause.message}`
          })
      )
    )
    // -u: the size is given, so the backing (in use) is not opened
    yield* runTool(target, qemuImg, [
      "create",
      "-q",
      "-f",
      "qcow2",
      "-F",
      "qcow2",
      "-b",
      path.resolve(backing),
      "-u",
      "-o",
      "lazy_refcounts=off",
      target,
      String(size["virtual-size"])
    ])
    yield* io(target, "chmod", () => fs.chmod(target, 0o600))
  })

/** the `next` overlays of a drive in `dir`, lowest number first */
const nextOverlays = (dir: string, drive: FrozenDrive) =>
  Effect.promise(() => fs.readdir(dir).catch(() => [] as Array<string>)).pipe(
    Effect.map((names) =>
      names
        .flatMap((name) => {
          const match = NEXT.exec(name)
          return match !== null && match[1] === drive ? [{ name, n: Number(match[2]) }] : []
        })
        .sort((a, b) => a.n - b.n)
        .map((entry) => path.join(dir, entry.name))
    )
  )

/** the file a drive writes now: its newest `next` overlay (a running VM forked), else the active disk */
export const writingDisk = (dir: string, drive: FrozenDrive) =>
  Effect.map(nextOverlays(dir, drive), (next) => next.at(-1) ?? activeDisk(dir, drive))

/**
 * After a running VM was forked and is down again: its newest `next` overlay is renamed over
 * the active disk (the old active disk is a frozen layer by its other name), older ones (frozen
 * layers too, by their other names) unlinked. Only by the session's lock holder, before a boot.
 */
export const settleDisks = Effect.fn("frozenLayers.settle")(function* (dir: string) {
  for (const drive of ["root", "repo"] as const) {
    const next = yield* nextOverlays(dir, drive)
    const newest = next.at(-1)
    if (newest === undefined) continue
    for (const older of next.slice(0, -1)) {
      const links = yield* io(older, "stat", () => fs.stat(older))
      if (links.nlink > 1) yield* io(older, "unlink", () => fs.rm(older, { force: true }))
    }
    yield* io(newest, "rename", () => fs.rename(newest, activeDisk(dir, drive)))
  }
})

/** one drive of a freeze: the disk it writes, the frozen name that gets, the new overlay's name */
export interface FreezeStep {
  readonly drive: FrozenDrive
  readonly active: string
  readonly frozen: string
  readonly next: string
}

/**
 * Freeze's first half, for each qcow2 disk the session has: the disk a drive writes gets its
 * frozen name too (a hard link: a VM writing it goes on writing the same inode), and an empty
 * overlay over the frozen name is made, under a temporary name (a stopped session: `commit`
 * renames it over the active disk) or as the `next` overlay (a running VM goes on in it).
 */
export const prepareFreeze = Effect.fn("frozenLayers.prepare")(function* (
  qemuImg: string,
  dir: string,
  running: boolean
) {
  const n = yield* nextFrozenIndex(dir)
  const steps: Array<FreezeStep> = []
  for (const drive of ["root", "repo"] as const) {
    const active = yield* writingDisk(dir, drive)
    if (!(yield* exists(active))) continue
    const frozen = path.join(dir, frozenName(drive, n))
    const next = running ? path.join(dir, nextName(drive, n)) : temporaryBeside(active)
    yield* io(frozen, "link", () => fs.link(active, frozen))
    yield* createQcow2Overlay(qemuImg, frozen, next).pipe(
      Effect.tapError(() => Effect.promise(() => fs.rm(next, { force: true })))
    )
    steps.push({ drive, active, frozen, next })
  }
  return steps as ReadonlyArray<FreezeStep>
})

/** a stopped session's freeze, second half: the new overlay renamed over the active name */
export const commitFreezeStep = (step: FreezeStep) =>
  io(step.active, "rename", () => fs.rename(step.next, step.active))

/** a prepared freeze given up: the new overlays removed (a frozen link left is gc's) */
export const abandonFreeze = (steps: ReadonlyArray<FreezeStep>) =>
  Effect.promise(() => Promise.all(steps.map((step) => fs.rm(step.next, { force: true })))).pipe(
    Effect.asVoid
  )

/** the frozen layers a freeze made, by drive */
export interface FrozenLayers {
  readonly root?: string | undefined
  readonly repo?: string | undefined
}

export const frozenOf = (steps: ReadonlyArray<FreezeStep>): FrozenLayers => ({
  root: steps.find((s) => s.drive === "root")?.frozen,
  repo: steps.find((s) => s.drive === "repo")?.frozen
})

const ChainEntry = Schema.Struct({
  filename: Schema.String,
  format: Schema.String,
  "full-backing-filename": Schema.optional(Schema.String),
  "backing-filename": Schema.optional(Schema.String)
})
const decodeChain = Schema.decodeUnknown(Schema.parseJson(Schema.Array(ChainEntry)))

/** one file of a disk's backing chain and the file it reads through to (absolute), if any */
export interface ChainLink {
  readonly file: string
  readonly format: string
  readonly backing: string | undefined
  readonly backingFormat: string | undefined
}

/**
 * The backing chain of a qcow2 disk, from the disk itself down to its last backing file
 * (`qemu-img info --backing-chain -U`: a running VM's disks are read too)
 */
export const backingChain = Effect.fn("frozenLayers.chain")(function* (qemuImg: string, file: string) {
  const text = yield* runTool(file, qemuImg, ["info", "-U", "--backing-chain", "--output=json", file])
  const entries = yield* decodeChain(text).pipe(
    Effect.mapError(
      (cause) =>
        new DiskError({ path: file, reason: "tool", message: `qemu-img info ${file}: ${cause.message}` })
    )
  )
  return entries.map((entry, i): ChainLink => {
    const relative = entry["full-backing-filename"] ?? entry["backing-filename"]
    return {
      file: path.resolve(entry.filename),
      format: entry.format,
      backing:
        relative === undefined
          ? undefined
          : path.resolve(path.dirname(path.resolve(entry.filename)), relative),
      backingFormat: entries[i + 1]?.format
    }
  }) as ReadonlyArray<ChainLink>
})
