import * as Effect from "effect/Effect"
// node's lstat: @effect/platform's stat follows links, and a link in a session's repository copy
// may point anywhere (`/`)
import * as fs from "node:fs"
import * as path from "node:path"

/**
 * Bytes a directory takes on disk (allocated blocks, so a sparse root.raw counts what it holds,
 * not its apparent size), symlinks not followed. Entries that vanish or cannot be read while
 * walking count as 0: this is a figure for people, never a reason to fail.
 *
 * The walk is synchronous, in one Effect: a session directory holds a handful of files (the
 * repository and the guest's disk are image files), and `abox list` walks every session, where
 * a fiber, a promise and a thread-pool round trip per lstat cost many times the lstat itself.
 */
export const diskUsage = (
  dir: string,
  /** told the names directly in `dir` (saves the caller a second readdir) */
  onTopEntries?: (entries: ReadonlyArray<string>) => void
): Effect.Effect<number> => Effect.sync(() => diskUsageSync(dir, onTopEntries))

/** `diskUsage` as a plain function, for a caller that walks many directories in one pass */
export const diskUsageSync = (
  dir: string,
  onTopEntries?: (entries: ReadonlyArray<string>) => void
): number => {
  const walk = (file: string): number => {
    try {
      const info = fs.lstatSync(file)
      if (!info.isDirectory()) return info.blocks * 512
      const entries = fs.readdirSync(file)
      if (file === dir) onTopEntries?.(entries)
      return entries.reduce((total, entry) => total + walk(path.join(file, entry)), info.blocks * 512)
    } catch {
      return 0
    }
  }
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
