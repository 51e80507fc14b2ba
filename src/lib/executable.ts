// Raw node:fs: a PATH lookup is a plain access check, synchronous so that it can run while a
// layer or a command line is being built.
import * as fs from "node:fs"
import * as path from "node:path"

/**
 * The executable `name` on PATH, then in `extraDirs`; a name with a `/` is checked as it is.
 * Undefined when there is none (not there, not a regular file, or not executable).
 */
export const findExecutable = (name: string, extraDirs: ReadonlyArray<string> = []): string | undefined => {
  const candidates = name.includes("/")
    ? [name]
    : [
        ...(process.env.PATH ?? "/usr/bin:/bin").split(path.delimiter).filter((dir) => dir !== ""),
        ...extraDirs
      ].map((dir) => path.join(dir, name))
  return candidates.find((candidate) => {
    try {
      fs.accessSync(candidate, fs.constants.X_OK)
      return fs.statSync(candidate).isFile()
    } catch {
      return false
    }
  })
}
