import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import type { Stats } from "node:fs"
import { constants as fsConstants } from "node:fs"
import * as fs from "node:fs/promises"
import * as path from "node:path"
import * as tar from "tar"
import { TransferFailed } from "../domain/transfer.js"
import { errorMessage } from "../domain/errorMessage.js"
import { SourceInvalid } from "../domain/transfer.js"

export { SourceInvalid } from "../domain/transfer.js"

/** What a walk of the source found, before anything is copied. */
export interface SourceScan {
  /** the source directory, resolved once (a source path that is a symlink names its target) */
  readonly root: string
  /** regular files and symlinks */
  readonly files: number
  readonly dirs: number
  /** the files' sizes (what a byte copy reads) */
  readonly bytes: number
  /** what the files occupy (st_blocks × 512): holes of sparse files are not counted */
  readonly allocated: number
  /** the most entries one directory holds */
  readonly widestDir: number
  /** entries left out (sockets, fifos, devices), relative to the root */
  readonly skipped: ReadonlyArray<string>
}

export interface Snapshot {
  /** the tar stream of the tree: regular files, directories and symlinks (as links) */
  readonly tar: Stream.Stream<Uint8Array, TransferFailed>
  /** entries left out (sockets, fifos, devices), relative to the source */
  readonly skipped: ReadonlyArray<string>
  readonly scan: SourceScan
}

const kept = (stat: Stats): boolean => stat.isFile() || stat.isDirectory() || stat.isSymbolicLink()

/** The source directory, resolved once: a path that is itself a symlink names its target. */
export const resolveSource = Effect.fn("resolveSource")(function* (source: string) {
  const given = path.resolve(source)
  const root = yield* Effect.tryPromise({
    try: () => fs.realpath(given),
    catch: (cause) =>
      new SourceInvalid({
        path: given,
        message: `cannot read source directory ${given}: ${errorMessage(cause)}`
      })
  })
  const stat = yield* Effect.tryPromise({
    try: () => fs.stat(root),
    catch: (cause) =>
      new SourceInvalid({
        path: root,
        message:
          (cause as { code?: unknown }).code === "ENOENT"
            ? `source ${root} does not exist`
            : `cannot read source directory ${root}: ${errorMessage(cause)}`
      })
  })
  if (!stat.isDirectory()) {
    return yield* new SourceInvalid({ path: given, message: `source ${given} is not a directory` })
  }
  return root
})

/**
 * Walks the tree once (lstat, never following a link): every directory must be listable and
 * every regular file readable, else `SourceInvalid` names the first one that is not — checked
 * here, before a session exists, so that no copy fails halfway. Counts what a copy moves.
 */
export const scanSource = Effect.fn("scanSource")(function* (root: string) {
  const unreadable = (file: string, cause: unknown) =>
    new SourceInvalid({ path: file, message: `cannot read ${file} in the source: ${errorMessage(cause)}` })
  return yield* Effect.tryPromise({
    try: async (): Promise<SourceScan> => {
      let files = 0
      let dirs = 0
      let bytes = 0
      let allocated = 0
      let widestDir = 0
      const skipped: Array<string> = []
      const pending = [""]
      while (pending.length > 0) {
        const rel = pending.pop()!
        const dir = path.join(root, rel)
        let entries
        try {
          entries = await fs.readdir(dir, { withFileTypes: true })
        } catch (cause) {
          throw unreadable(dir, cause)
        }
        widestDir = Math.max(widestDir, entries.length)
        for (const entry of entries) {
          const relPath = rel === "" ? entry.name : `${rel}/${entry.name}`
          const full = path.join(dir, entry.name)
          if (entry.isDirectory()) {
            dirs++
            pending.push(relPath)
          } else if (entry.isSymbolicLink()) {
            files++
          } else if (entry.isFile()) {
            let stat
            try {
              stat = await fs.lstat(full)
              await fs.access(full, fsConstants.R_OK)
            } catch (cause) {
              throw unreadable(full, cause)
            }
            files++
            bytes += stat.size
            allocated += stat.blocks * 512
          } else {
            skipped.push(relPath)
          }
        }
      }
      return { root, files, dirs, bytes, allocated, widestDir, skipped }
    },
    catch: (cause) => (cause instanceof SourceInvalid ? cause : unreadable(root, cause))
  })
})

/**
 * An exact snapshot of `source` as a tar stream: files with their modes, directories, and
 * symlinks stored as links — never followed, so nothing outside the tree is read. Sockets,
 * fifos and devices are skipped and named in `skipped`. The source is resolved and scanned
 * first (`resolveSource`, `scanSource`): an unreadable entry is a `SourceInvalid` naming it.
 */
export const snapshotSource = Effect.fn("snapshotSource")(function* (source: string) {
  const root = yield* resolveSource(source)
  const scan = yield* scanSource(root)
  return { tar: tarSnapshot(root).tar, skipped: scan.skipped, scan } satisfies Snapshot
})

/** the tar stream of a directory (the snapshot's tar path, and `abox cp` into a session) */
export const tarSnapshot = (root: string, entries: ReadonlyArray<string> = ["."]) => {
  const skipped: Array<string> = []
  const tarStream = Stream.suspend(() => {
    const pack = tar.c(
      {
        cwd: root,
        follow: false,
        portable: true,
        filter: (entryPath: string, entry: Stats | tar.ReadEntry) => {
          if (
            "isSymbolicLink" in entry &&
            typeof entry.isSymbolicLink === "function" &&
            !kept(entry as Stats)
          ) {
            skipped.push(entryPath)
            return false
          }
          return true
        }
      },
      [...entries]
    )
    // node-tar reports a file it cannot read as an 'error' event on the pack: it ends the stream
    // (and so the transfer) with a typed failure instead of an unhandled 'error'
    const failed = new Promise<never>((_, reject) => {
      pack.on("error", (cause: unknown) => reject(cause))
    })
    failed.catch(() => undefined)
    const iterable: AsyncIterable<Uint8Array> = {
      [Symbol.asyncIterator]: () => {
        const inner = (pack as unknown as AsyncIterable<Uint8Array>)[Symbol.asyncIterator]()
        return {
          next: () => Promise.race([inner.next(), failed]),
          return: (value?: unknown) =>
            inner.return?.(value) ?? Promise.resolve({ done: true as const, value: undefined })
        }
      }
    }
    return Stream.fromAsyncIterable(
      iterable,
      (cause) =>
        new TransferFailed({
          reason: "snapshot",
          message: `snapshot of ${root} failed: ${errorMessage(cause)}`
        })
    )
  })
  return { tar: tarStream, skipped }
}
