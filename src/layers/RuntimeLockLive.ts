import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
// Raw node:fs here: the lock is an OS file descriptor that is locked with flock-style locks and
// later handed to a child process (`stdio` extra fd), which @effect/platform's File does not expose.
import * as fs from "node:fs"
import { createRequire } from "node:module"
import * as path from "node:path"
import { AboxPaths } from "../services/AboxPaths.js"
import { type HeldLock, LockError, RuntimeLock, SessionBusy } from "../services/RuntimeLock.js"
import { sessionFile, type SessionLocation } from "../domain/sessionLayout.js"
import { errorMessage } from "../domain/errorMessage.js"

/**
 * The per-session runtime lock: `<session dir>/lock` in the directory SessionStore located (the
 * current home or the legacy one; 0600, created when absent, never deleted), locked exclusively
 * and without waiting through `fs-native-extensions`: flock(2) on macOS, open-file-description locks (F_OFD_SETLK) on Linux. Both belong to the
 * open file description, not to the process, so:
 *
 * - every `acquire` opens the file afresh: a second acquire in the same process (another
 *   fiber or scope) conflicts exactly like another process does, and fails `SessionBusy`;
 * - the kernel drops the lock when the last fd on that description closes, so a crashed
 *   supervisor leaves no stale lock;
 * - a child that inherits the fd (the VMM helper) shares the lock.
 *
 * Release semantics: closing the scope unlocks and closes the fd. Unlocking would also free
 * the lock for a child that inherited the fd, so once the fd has been handed to a child that
 * may outlive the scope, call `held.handOff`: the release then only closes this process's fd,
 * and the lock lives exactly as long as the child (or any other holder of the description).
 */

interface NativeLocks {
  readonly tryLock: (fd: number) => boolean
  readonly unlock: (fd: number) => void
}

// a CommonJS native addon without type declarations; the bundle keeps it external. Loaded on the
// first lock taken: `abox list` builds this layer on every start, and a session that never ran
// has no lock file to probe (loading the addon costs more than the rest of the layer)
let nativeLocksLoaded: NativeLocks | undefined
const nativeLocks = (): NativeLocks =>
  (nativeLocksLoaded ??= createRequire(import.meta.url)("fs-native-extensions") as NativeLocks)

const errorCode = (cause: unknown): string | undefined =>
  typeof cause === "object" && cause !== null && "code" in cause && typeof cause.code === "string"
    ? cause.code
    : undefined

/** what a session id may look like on disk: one path segment */
const isPlainSegment = (id: string): boolean =>
  id.length > 0 && id !== "." && id !== ".." && !id.includes("/") && !id.includes("\\") && !id.includes("\0")

export const RuntimeLockLive = Layer.effect(
  RuntimeLock,
  Effect.gen(function* () {
    const paths = yield* AboxPaths

    const open = (sessionId: string, lockPath: string) =>
      Effect.try({
        try: () => fs.openSync(lockPath, fs.constants.O_RDWR | fs.constants.O_CREAT, 0o600),
        catch: (cause) =>
          new LockError({
            path: lockPath,
            message:
              errorCode(cause) === "ENOENT"
                ? `session ${sessionId} has no directory (${path.dirname(lockPath)})`
                : `cannot open the lock file: ${errorMessage(cause)}`
          })
      })

    const closeQuietly = (fd: number) =>
      Effect.sync(() => {
        try {
          fs.closeSync(fd)
        } catch {
          // already closed: nothing left to release
        }
      })

    const busy = (sessionId: string) =>
      new SessionBusy({ sessionId, message: `session ${sessionId} is in use by another abox process` })

    const lock = (sessionId: string, lockPath: string, fd: number) =>
      Effect.try({
        try: () => nativeLocks().tryLock(fd),
        catch: (cause) =>
          // F_OFD_SETLK may report a conflict as EACCES instead of EAGAIN
          errorCode(cause) === "EACCES" || errorCode(cause) === "EAGAIN"
            ? busy(sessionId)
            : new LockError({ path: lockPath, message: `cannot lock: ${errorMessage(cause)}` })
      }).pipe(
        Effect.filterOrFail(
          (locked) => locked,
          () => busy(sessionId)
        ),
        Effect.tapError(() => closeQuietly(fd)),
        Effect.asVoid
      )

    const acquire = Effect.fn("RuntimeLock.acquire")(function* (session: SessionLocation | string) {
      const sessionId = typeof session === "string" ? session : session.id
      if (!isPlainSegment(sessionId)) {
        return yield* new LockError({
          path: sessionId,
          message: `not a session id: ${JSON.stringify(sessionId)}`
        })
      }
      const lockPath = sessionFile(
        typeof session === "string" ? paths.sessionDir(sessionId) : session.dir,
        "lock"
      )
      let handedOff = false
      const held: HeldLock = yield* Effect.acquireRelease(
        open(sessionId, lockPath).pipe(
          Effect.tap((fd) => lock(sessionId, lockPath, fd)),
          Effect.map((fd): HeldLock => ({
            sessionId,
            path: lockPath,
            fd,
            handOff: Effect.sync(() => {
              handedOff = true
            })
          }))
        ),
        (held) =>
          Effect.sync(() => {
            if (!handedOff) {
              try {
                nativeLocks().unlock(held.fd)
              } catch {
                // closing the fd below releases it anyway
              }
            }
          }).pipe(Effect.zipRight(closeQuietly(held.fd)))
      )
      return held
    })

    return { acquire }
  })
)
