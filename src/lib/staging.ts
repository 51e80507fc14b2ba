/**
 * Staging directories under `images/` (an image build, an import, an environment image): named
 * `.<kind>-<pid>-<random>` after the process that makes them, so that `abox gc` can tell one
 * whose process is gone (interrupted: removed) from one being written now (kept). Directories
 * named before the pid was part of the name are removed once a day old.
 */
import * as crypto from "node:crypto"
import * as path from "node:path"

export type StagingKind = "build" | "import" | "import-work" | `env-${string}`

/** a new staging directory's path (not made) */
export const stagingPath = (imagesDir: string, kind: StagingKind): string =>
  path.join(imagesDir, `.${kind}-${process.pid}-${crypto.randomBytes(6).toString("hex")}`)

const OWNED = /^\.(build|import-work|import|env-[0-9a-f]{16})-(\d{1,10})-[0-9a-f]{8,12}$/
const UNOWNED = /^\.(build|import-work|import|env-[0-9a-f]{16})-[0-9a-f]{8,12}$/

/**
 * What an entry of `images/` is: a staging directory with the pid that makes it, one without (an
 * older name), or not a staging directory at all (undefined).
 */
export const stagingOwner = (name: string): { readonly pid: number | undefined } | undefined => {
  const owned = OWNED.exec(name)
  if (owned !== null) return { pid: Number(owned[2]) }
  return UNOWNED.test(name) ? { pid: undefined } : undefined
}

/** whether a process with that pid exists (one of another user's counts: it may be writing) */
export const processAlive = (pid: number): boolean => {
  try {
    process.kill(pid, 0)
    return true
  } catch (error) {
    return (error as NodeJS.ErrnoException).code === "EPERM"
  }
}
