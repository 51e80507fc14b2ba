import * as Effect from "effect/Effect"
import * as fs from "node:fs/promises"
import { diskUsageSync } from "../lib/diskUsage.js"
import { sharedBytesSync } from "../lib/rootDisk.js"
import { AboxPaths } from "../services/AboxPaths.js"
import { RuntimeLock } from "../services/RuntimeLock.js"
import { SessionStore, type SessionListing } from "../services/SessionStore.js"
import { SESSION_FILES, sessionFile, type SessionLocation } from "../domain/sessionLayout.js"

export type SessionStatus = "running" | "stopped"

/**
 * Running or stopped, from the session's runtime lock: a running session's supervisor (and its
 * VM helper) holds it. The probe takes the lock for an instant and gives it back, in the
 * directory the session lives in (the legacy home too).
 */
export const sessionStatus = Effect.fn("sessionStatus")(function* (
  session: SessionLocation,
  /** whether the session directory has a lock file, when the caller has read the directory already */
  hasLockFile?: boolean
) {
  const lock = yield* RuntimeLock
  // a session that never ran has no lock file: nothing to probe, and nothing written by looking
  const hasLock =
    hasLockFile ??
    (yield* Effect.promise(() =>
      fs.access(sessionFile(session.dir, "lock")).then(
        () => true,
        () => false
      )
    ))
  if (!hasLock) return "stopped" as SessionStatus
  return yield* Effect.scoped(lock.acquire(session)).pipe(
    Effect.as("stopped" as SessionStatus),
    Effect.catchTag("SessionBusy", () => Effect.succeed("running" as SessionStatus)),
    // no lock file can be made (a directory without write access): not running under abox
    Effect.catchTag("LockError", () => Effect.succeed("stopped" as SessionStatus))
  )
})

export type ListedSession = SessionListing & {
  readonly names: ReadonlyArray<string>
  readonly status: SessionStatus
  /** bytes on disk (allocated: the sparse guest disk counts what it holds): the session's own */
  readonly bytes: number
  /** the image's bytes its root disk backs onto (an overlay), shared with every such session */
  readonly sharedBytes: number
}

/**
 * Every session (current and legacy home) with its names, status and disk usage. The disk usage
 * walks (which also say whether a session has a lock file) run in one synchronous pass, and only
 * a session with a lock file has it probed: a fiber per session cost more than its few syscalls
 * (`abox list` over 1,000 sessions, docs/performance.md).
 */
export const listSessions = Effect.fn("listSessions")(function* () {
  const store = yield* SessionStore
  const paths = yield* AboxPaths
  const [rows, names] = yield* Effect.all([store.list(), store.listNames()], { concurrency: 2 })
  const namesOf = new Map<string, Array<string>>()
  for (const b of names) {
    const of = namesOf.get(b.sessionId)
    if (of === undefined) namesOf.set(b.sessionId, [b.name])
    else of.push(b.name)
  }
  const usage = yield* Effect.sync(() =>
    rows.map((row) => {
      let hasLockFile = false
      const bytes = diskUsageSync(row.dir, (entries) => (hasLockFile = entries.includes(SESSION_FILES.lock)))
      const sharedBytes =
        row._tag === "Ok" ? sharedBytesSync(paths.images, row.meta.image, row.meta.rootDisk) : 0
      return { bytes, sharedBytes, hasLockFile }
    })
  )
  const locked = rows.filter((_, i) => usage[i]!.hasLockFile)
  const lockedStatus = yield* Effect.forEach(locked, (row) => sessionStatus(row, true), { concurrency: 8 })
  const statusOf = new Map(locked.map((row, i) => [row, lockedStatus[i]!]))
  return rows.map((row, i): ListedSession => ({
    ...row,
    names: namesOf.get(row.id) ?? [],
    status: statusOf.get(row) ?? "stopped",
    bytes: usage[i]!.bytes,
    sharedBytes: usage[i]!.sharedBytes
  }))
})
