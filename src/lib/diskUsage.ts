import * as Effect from "effect/Effect"
// node's lstat: @effect/platform's stat follows links, and a link in a session's repository copy
// may point anywhere (`/`)
import * as fs from "node:fs/promises"
import * as path from "node:path"

/**
 * Bytes a directory takes on disk (allocated blocks, so a sparse root.raw counts what it holds,
 * not its apparent size), symlinks not followed. Entries that vanish or cannot be read while
 * walking count as 0: this is a figure for people, never a reason to fail.
 */
export const diskUsage = (
  dir: string,
  /** told the names directly in `dir` (saves the caller a second readdir) */
  onTopEntries?: (entries: ReadonlyArray<string>) => void
): Effect.Effect<number> => {
  const walk = (file: string): Effect.Effect<number> =>
    Effect.gen(function* () {
      const info = yield* Effect.tryPromise(() => fs.lstat(file))
      if (!info.isDirectory()) return info.blocks * 512
      const entries = yield* Effect.tryPromise(() => fs.readdir(file))
      if (file === dir) onTopEntries?.(entries)
      const sizes = yield* Effect.forEach(entries, (entry) => walk(path.join(file, entry)), {
        concurrency: 8
      })
      return sizes.reduce((a, b) => a + b, info.blocks * 512)
    }).pipe(Effect.orElseSucceed(() => 0))
  return walk(dir)
}

/** 1.2 GB, 110 MB, 4.0 kB: decimal units, as `du -h --si` */
export const formatBytes = (bytes: number): string => {
  const units = ["B", "kB", "MB", "GB", "TB"]
  let value = bytes
  let unit = 0
  while (value >= 1000 && unit < units.length - 1) {
    value /= 1000
    unit++
  }
  return unit === 0 ? `${value} B` : `${value < 10 ? value.toFixed(1) : Math.round(value)} ${units[unit]}`
}
