/**
 * The repository disks of a session (docs/on-disk.md, "Repository disks"): Open builds the
 * snapshot as an ext4 file system on the host (`mkfs.ext4 -d <source>`, as images/build-small.sh
 * builds the golden root) instead of streaming a tar into the running guest, which under TCG
 * costs ~16 ms of guest CPU per file. The guest mounts it on /work/repo at every boot
 * (src/guest/repoDisk.ts), so Open copies nothing inside the VM and Resume finds the work where
 * it was.
 *
 * - `repo-base.raw`: the snapshot as it was taken, never written again; the
 *   baseline of `abox diff`, attached read-only.
 * - `repo.qcow2` (QEMU: a copy-on-write overlay whose backing file is repo-base.raw, O(1)) or
 *   `repo.raw` (vfkit, raw only: a clone of it): the guest's /work/repo. The guest tells them apart by their
 *   virtio serial numbers, `abox-repo` and `abox-base` (both hold the same file system at first).
 *
 * Exactness: `mkfs.ext4 -d` copies regular files (holes kept: SEEK_DATA/SEEK_HOLE), directories
 * (empty ones too), symlinks as links (never followed) and hard links, with their modes and
 * times. Sockets, FIFOs and devices are removed from the image again (`skipped`). Every inode is
 * then given to the guest's repository user (REPO_OWNER) with debugfs, so the guest does not
 * chown thousands of files under emulation.
 */
import * as Effect from "effect/Effect"
import * as fs from "node:fs/promises"
import * as path from "node:path"
import { DiskError } from "../domain/image.js"
import type { RepoDiskFormat, RepoDisks } from "../domain/vm.js"
import { alignDiskSize, checkFreeSpace } from "./disk.js"
import type { SourceScan } from "./snapshot.js"
import { sessionFile } from "../domain/sessionLayout.js"
import { findExecutable } from "./executable.js"
import { runCommand } from "./command.js"
import { errorMessage } from "../domain/errorMessage.js"

/** uid:gid of the repository user in abox images (images/build-*.sh: `agent`, 1000:1000) */
export const REPO_OWNER = { uid: 1000, gid: 1000 } as const
/** the virtio serials the guest finds the disks by (QEMU `serial=`, vfkit `deviceId=`) */
export const REPO_SERIAL = "abox-repo"
export const BASE_SERIAL = "abox-base"
const BASE_LABEL = "abox-base"
/** the file system's size (sparse: the host stores only what is written); room for the agent's work */
export const MIN_REPO_DISK_BYTES = 8 * 1024 * 1024 * 1024

export const repoDiskFiles = (dir: string, format: RepoDiskFormat) => ({
  base: sessionFile(dir, "repoBase"),
  repo: sessionFile(dir, format === "qcow2" ? "repoQcow2" : "repoRaw")
})

/** the disks a session directory holds, if any (sessions made before them have none) */
export const existingRepoDisks = (dir: string): Effect.Effect<RepoDisks | undefined> =>
  Effect.promise(async () => {
    const exists = (file: string) =>
      fs.access(file).then(
        () => true,
        () => false
      )
    for (const format of ["qcow2", "raw"] as const) {
      const files = repoDiskFiles(dir, format)
      if ((await exists(files.base)) && (await exists(files.repo))) {
        return { repo: files.repo, repoFormat: format, base: files.base }
      }
    }
    return undefined
  })

const TOOL_DIRS = [
  "/usr/sbin",
  "/sbin",
  "/usr/local/sbin",
  "/opt/homebrew/opt/e2fsprogs/sbin",
  "/usr/local/opt/e2fsprogs/sbin"
]

/** a tool by name on PATH or in the sbin directories (mkfs.ext4 is not on a user's PATH everywhere) */
export const findTool = (name: string): Effect.Effect<string | undefined> =>
  Effect.sync(() => findExecutable(name, TOOL_DIRS))

/** the tools a repository disk needs, or undefined (then Open streams a tar instead) */
export const repoDiskTools = (format: RepoDiskFormat) =>
  Effect.gen(function* () {
    const mkfs = yield* findTool("mkfs.ext4")
    const debugfs = yield* findTool("debugfs")
    const dumpe2fs = yield* findTool("dumpe2fs")
    const qemuImg = format === "qcow2" ? yield* findTool("qemu-img") : ""
    if (mkfs === undefined || debugfs === undefined || dumpe2fs === undefined || qemuImg === undefined)
      return undefined
    // optional: without it mkfs and debugfs end with an fsync of the whole image (0.5 s and more
    // for 200 MB on a busy disk), which a fresh snapshot of a source that is still there does
    // not need (the root disk's clone is not synced either)
    const eatmydata = yield* findTool("eatmydata")
    return { mkfs, debugfs, dumpe2fs, qemuImg, eatmydata }
  })
export type RepoDiskTools = NonNullable<Effect.Effect.Success<ReturnType<typeof repoDiskTools>>>

const diskError = (file: string, reason: string, message: string) =>
  new DiskError({ path: file, reason, message })

/** runs a tool to its end (killed if interrupted); stdout returned, stderr in the error */
export const runTool = (file: string, command: string, args: ReadonlyArray<string>, input?: string) =>
  runCommand(command, args, { input, env: { PATH: process.env.PATH ?? "/usr/bin:/bin", LANG: "C" } }).pipe(
    Effect.catchTags({
      CommandNotRun: (error) =>
        Effect.fail(
          new DiskError({
            path: file,
            reason: "tool",
            message: `${command}: ${errorMessage(error.cause)}`,
            cause: error
          })
        ),
      // no limit is given: never happens
      CommandOutputTooLarge: (error) => Effect.die(error)
    }),
    Effect.flatMap((result) =>
      result.exitCode === 0
        ? Effect.succeed(result.stdout.toString("utf8"))
        : Effect.fail(
            diskError(
              file,
              "tool",
              `${path.basename(command)} exited ${result.exitCode}: ${result.stderr.trim().slice(-2000)}`
            )
          )
    )
  )

/** the inodes in use (≥ 11, the first non-reserved), from dumpe2fs's per-group free ranges */
export const usedInodes = (dumpe2fs: string): ReadonlyArray<number> => {
  const count = Number(/^Inode count:\s+(\d+)/m.exec(dumpe2fs)?.[1] ?? "0")
  const free = new Uint8Array(count + 1)
  for (const line of dumpe2fs.matchAll(/^\s+Free inodes: (.*)$/gm)) {
    for (const range of line[1]!.split(",")) {
      const m = /^\s*(\d+)(?:-(\d+))?\s*$/.exec(range)
      if (m === null) continue
      const from = Number(m[1])
      const to = m[2] === undefined ? from : Number(m[2])
      for (let i = from; i <= to && i <= count; i++) free[i] = 1
    }
  }
  const used: Array<number> = []
  for (let i = 11; i <= count; i++) if (free[i] === 0) used.push(i)
  return used
}

/** a debugfs argument: double-quoted; names with a quote, backslash or newline cannot be written */
const debugfsPath = (rel: string): string | undefined => (/["\\\n\r]/.test(rel) ? undefined : `"/${rel}"`)

/**
 * Builds the repository disks of a new session from a scanned source. Checks free space first
 * (what the files occupy, holes not counted, plus a margin): a clear `no-space` error instead of
 * a full disk. Returns undefined when a skipped entry has a name debugfs cannot express (then
 * Open streams a tar instead).
 */
export const buildRepoDisks = Effect.fn("repoDisk.build")(function* (
  scan: SourceScan,
  sessionDir: string,
  format: RepoDiskFormat,
  tools: RepoDiskTools
) {
  const files = repoDiskFiles(sessionDir, format)
  const removals = scan.skipped.map(debugfsPath)
  if (removals.some((p) => p === undefined)) return undefined
  // the data, inode tables and directories, and the journal, with a margin; holes are not counted
  const metadata = (scan.files + scan.dirs) * 512 + 96 * 1024 * 1024
  yield* checkFreeSpace(sessionDir, scan.allocated + metadata)
  // a whole number of MiB: Virtualization.framework refuses a size that is not a multiple of 512
  const size = alignDiskSize(Math.max(MIN_REPO_DISK_BYTES, 4 * (scan.bytes + metadata)))
  yield* Effect.tryPromise({
    try: async () => {
      const handle = await fs.open(files.base, "wx", 0o600)
      await handle.truncate(size)
      await handle.close()
    },
    catch: (cause) => diskError(files.base, "create", `cannot create ${files.base}: ${String(cause)}`)
  })
  const unsynced = (command: string, args: ReadonlyArray<string>) =>
    tools.eatmydata === undefined
      ? ([command, args] as const)
      : ([tools.eatmydata, [command, ...args]] as const)
  yield* runTool(
    files.base,
    ...unsynced(tools.mkfs, [
      "-q",
      "-F",
      "-t",
      "ext4",
      "-L",
      BASE_LABEL,
      // the inode tables and journal are not zeroed (the guest mounts with noinit_itable)
      "-E",
      `root_owner=${REPO_OWNER.uid}:${REPO_OWNER.gid},lazy_itable_init=1,lazy_journal_init=1`,
      "-d",
      scan.root,
      files.base
    ])
  ).pipe(
    Effect.mapError((error) =>
      diskError(scan.root, "snapshot", `cannot copy the source ${scan.root} into a disk: ${error.message}`)
    )
  )
  // the guest's repository user owns every entry; sockets, FIFOs and devices go again
  const layout = yield* runTool(files.base, tools.dumpe2fs, [files.base])
  // mkfs makes /lost+found, which the source does not have: the snapshot is exact without it
  const ownLostFound = yield* Effect.promise(() =>
    fs.lstat(path.join(scan.root, "lost+found")).then(
      () => true,
      () => false
    )
  )
  // ownership first (every inode in use), then the removals (whose inodes are freed)
  const script = [
    ...usedInodes(layout).flatMap((ino) => [
      `sif <${ino}> uid ${REPO_OWNER.uid}`,
      `sif <${ino}> gid ${REPO_OWNER.gid}`
    ]),
    ...(ownLostFound ? [] : ["rmdir /lost+found"]),
    ...removals.map((p) => `rm ${p}`)
  ].join("\n")
  yield* runTool(files.base, ...unsynced(tools.debugfs, ["-w", "-f", "-", files.base]), script + "\n")
  // the baseline stays as it is now; the guest writes to an overlay (qcow2) or a clone (raw)
  yield* Effect.tryPromise({
    try: () => fs.chmod(files.base, 0o400),
    catch: (cause) => diskError(files.base, "chmod", String(cause))
  })
  if (format === "qcow2") {
    // the backing file is named relative to the overlay: the session directory may move
    yield* runTool(files.repo, tools.qemuImg, [
      "create",
      "-q",
      "-f",
      "qcow2",
      "-F",
      "raw",
      "-b",
      path.basename(files.base),
      files.repo
    ])
  } else {
    yield* runTool(
      files.repo,
      "cp",
      process.platform === "darwin"
        ? ["-c", files.base, files.repo]
        : ["--reflink=auto", "--sparse=always", files.base, files.repo]
    )
  }
  // qemu-img and cp create it under the umask (0644; cp: the baseline's 0400): the owner's alone
  yield* Effect.tryPromise({
    try: () => fs.chmod(files.repo, 0o600),
    catch: (cause) => diskError(files.repo, "chmod", String(cause))
  })
  return { repo: files.repo, repoFormat: format, base: files.base } satisfies RepoDisks
})

/** removes a session's repository disks (a warm restore that failed: they are made again) */
export const removeRepoDisks = (dir: string): Effect.Effect<void> =>
  Effect.promise(() =>
    Promise.all(
      [sessionFile(dir, "repoBase"), sessionFile(dir, "repoQcow2"), sessionFile(dir, "repoRaw")].map((file) =>
        fs.rm(file, { force: true })
      )
    )
  ).pipe(Effect.asVoid)
