// Raw node:fs: the fallback directory is created and checked synchronously (mode 0700, owned by
// this user) right before a socket is bound in it; node:crypto for the hash.
import { createHash } from "node:crypto"
import * as fs from "node:fs"
import * as path from "node:path"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import { SESSION_FILES } from "../domain/sessionLayout.js"

/**
 * Unix socket paths live in `sockaddr_un.sun_path`: 104 bytes on macOS (and the BSDs), 108 on
 * Linux, including the terminating NUL. A path must fit in that minus one.
 */
export const maxSocketPathBytes = (platform: NodeJS.Platform): number => (platform === "linux" ? 107 : 103)

/** the directory of short socket paths: `/tmp/abox-<uid>` (0700, this user's own) */
export const shortSocketDir = (uid: number = process.getuid?.() ?? 0): string =>
  path.join("/tmp", `abox-${uid}`)

const fits = (file: string, platform: NodeJS.Platform) =>
  Buffer.byteLength(file) <= maxSocketPathBytes(platform)

/**
 * The host path of a session socket named `name` (`rpc.sock`, `vfkit.sock`): in the session
 * directory when it fits the platform's limit, else `/tmp/abox-<uid>/<hash>-<name>` where the
 * hash (sha256 of the session directory, 16 hex digits) keeps it unique per session and stable
 * across runs. The fallback must be recorded (session.json `rpcSocket`) so that every process
 * finds the same socket.
 */
export const sessionSocketPath = (
  sessionDir: string,
  name: string,
  platform: NodeJS.Platform = process.platform,
  uid?: number
): string => {
  const inDir = path.join(sessionDir, name)
  if (fits(inDir, platform)) return inDir
  const hash = createHash("sha256").update(path.resolve(sessionDir)).digest("hex").slice(0, 16)
  return path.join(shortSocketDir(uid), `${hash}-${name}`)
}

/** a session's control socket: `<dir>/control.sock`, or the short-path fallback (see `sessionSocketPath`) */
export const controlSocketPath = (sessionDir: string): string =>
  sessionSocketPath(sessionDir, SESSION_FILES.controlSocket)

/** the host end of the guest RPC channel of a session (see `sessionSocketPath`) */
export const rpcSocketPath = (
  sessionDir: string,
  platform: NodeJS.Platform = process.platform,
  uid?: number
): string => sessionSocketPath(sessionDir, SESSION_FILES.rpcSocket, platform, uid)

/** vfkit's RESTful API socket of a session (see `sessionSocketPath`) */
export const vfkitSocketPath = (
  sessionDir: string,
  platform: NodeJS.Platform = process.platform,
  uid?: number
): string => sessionSocketPath(sessionDir, SESSION_FILES.vfkitSocket, platform, uid)

export class SocketDirError extends Data.TaggedError("SocketDirError")<{
  readonly dir: string
  readonly reason: string
  readonly cause?: unknown
}> {
  override get message() {
    return `socket directory ${this.dir}: ${this.reason}`
  }
}

/**
 * Makes sure the directory a socket path lives in is safe before binding. The shared
 * `/tmp/abox-<uid>` fallback must be a real directory (not a symlink), owned by this user, with
 * mode 0700: anyone else could otherwise pre-create it and watch or replace our sockets.
 * Session directories are already 0700 and are left alone.
 */
export const ensureSocketDir = (socketPath: string, uid: number = process.getuid?.() ?? 0) =>
  Effect.suspend(() => {
    const dir = path.dirname(socketPath)
    if (dir !== shortSocketDir(uid)) return Effect.void
    return Effect.try({
      try: () => {
        try {
          fs.mkdirSync(dir, { mode: 0o700 })
        } catch (error) {
          if ((error as NodeJS.ErrnoException).code !== "EEXIST") throw error
        }
        const stat = fs.lstatSync(dir)
        if (!stat.isDirectory()) return "is not a directory"
        if (stat.uid !== uid) return `is owned by uid ${stat.uid}, not ${uid}`
        if ((stat.mode & 0o777) !== 0o700) fs.chmodSync(dir, 0o700)
        return undefined
      },
      catch: (cause) => new SocketDirError({ dir, reason: String(cause), cause })
    }).pipe(
      Effect.flatMap((problem) =>
        problem === undefined ? Effect.void : Effect.fail(new SocketDirError({ dir, reason: problem }))
      )
    )
  })
