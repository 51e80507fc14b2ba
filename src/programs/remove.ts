import * as Clock from "effect/Clock"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import { diskUsage } from "../lib/diskUsage.js"
import { RuntimeLock, SessionBusy } from "../services/RuntimeLock.js"
import { SessionStore, type NameBinding, type SessionMeta } from "../services/SessionStore.js"
import type { SessionLocation } from "../domain/sessionLayout.js"
import { frozenLayersIn } from "../lib/frozenLayers.js"
import { detachForks, forksOf, SessionHasForks } from "./fork.js"

/** what a removal deletes, told before it happens (the CLI's y/N prompt) and after */
export type Removal =
  | {
      readonly _tag: "Session"
      readonly ref: string
      readonly id: string
      readonly dir: string
      readonly names: ReadonlyArray<string>
      /** undefined when session.json does not decode (a corrupt session can still be removed) */
      readonly meta: SessionMeta | undefined
      /** bytes on disk: the guest disk with everything done in the session, the repository copy, logs */
      readonly bytes: number
      /** sessions forked from it that read its frozen layers: made independent first (--force) */
      readonly forks: ReadonlyArray<string>
      readonly location: SessionLocation
    }
  | {
      /** a dangling name: its session is gone, only the name file goes */
      readonly _tag: "Name"
      readonly ref: string
      readonly name: string
      readonly sessionId: string
    }

/** lock a session of the current home (the legacy home is read-only: store.remove refuses it) and say what removing it loses */
const prepare = Effect.fn("remove.prepare")(function* (
  ref: string,
  session: SessionLocation,
  names: ReadonlyArray<NameBinding>,
  force = false
) {
  const store = yield* SessionStore
  const lock = yield* RuntimeLock
  const { id, dir } = session
  if (!session.legacy) {
    yield* lock.acquire(session).pipe(
      Effect.catchTag(
        "SessionBusy",
        () =>
          new SessionBusy({
            sessionId: id,
            message: `session ${id} is running (another abox process holds it): close it first; nothing was removed`
          })
      )
    )
  }
  const meta = yield* store.get(id).pipe(Effect.orElseSucceed(() => undefined))
  // forks read its frozen layers: refused, or (force) they are made independent before it goes
  const forks = (yield* frozenLayersIn(dir)).length === 0 ? [] : yield* forksOf(session)
  if (forks.length > 0 && !force) {
    return yield* new SessionHasForks({
      sessionId: id,
      forks,
      message: `session ${id} has forks that read its disks (${forks.join(", ")}): remove them first, or --force makes them independent (their disks rebased off it) and then removes it; nothing was removed`
    })
  }
  const removal: Removal = {
    _tag: "Session",
    ref,
    id,
    dir,
    names: names.filter((b) => b.sessionId === id).map((b) => b.name),
    meta,
    bytes: yield* diskUsage(dir),
    forks,
    location: session
  }
  return removal
})

const removeAll = (removals: ReadonlyArray<Removal>) =>
  Effect.gen(function* () {
    const store = yield* SessionStore
    for (const removal of removals) {
      if (removal._tag === "Name") yield* store.unbindName(removal.name)
      else {
        if (removal.forks.length > 0) yield* detachForks(removal.location)
        yield* store.remove(removal.id)
      }
    }
  })

/**
 * Remove sessions (or dangling names), all or nothing: every ref is resolved and every session's
 * runtime lock taken first, so a session that is running (its VM holds the lock) fails the whole
 * removal with `SessionBusy` before anything is deleted; then `confirm` is asked with the list of
 * what will be lost; then each session's names are unbound and its directory removed, under its
 * lock. The one removal of CLI (`rm`, `run --rm`, `prune`) and SDK.
 */
export const remove = <E = never, R = never>(
  refs: ReadonlyArray<string>,
  confirm: (removals: ReadonlyArray<Removal>) => Effect.Effect<void, E, R> = () => Effect.void,
  options: { readonly force?: boolean | undefined } = {}
) =>
  Effect.scoped(
    Effect.gen(function* () {
      const store = yield* SessionStore
      const names = yield* store.listNames()
      const removals: Array<Removal> = []
      const seen = new Set<string>()
      for (const ref of refs) {
        const found = yield* store.locate(ref).pipe(Effect.either)
        if (found._tag === "Left") {
          const binding = yield* store.lookupName(ref).pipe(Effect.option)
          if (found.left._tag !== "SessionNotFound" || binding._tag === "None") return yield* found.left
          removals.push({ _tag: "Name", ref, name: ref, sessionId: binding.value.sessionId })
          continue
        }
        if (seen.has(found.right.id)) continue
        seen.add(found.right.id)
        removals.push(yield* prepare(ref, found.right, names, options.force === true))
      }
      yield* confirm(removals)
      yield* removeAll(removals)
      return removals as ReadonlyArray<Removal>
    })
  )

export interface PruneOptions {
  /** only sessions last used (closed, else created) longer ago than this; default: every one */
  readonly olderThan?: Duration.DurationInput | undefined
  /** say what would go, remove nothing */
  readonly dryRun?: boolean | undefined
}

export interface PruneResult {
  readonly removed: ReadonlyArray<Removal>
  readonly dryRun: boolean
  /** sessions that matched but were left: running ones, corrupt ones (remove those with rm) */
  readonly skipped: ReadonlyArray<{ readonly id: string; readonly reason: string }>
}

/** when a session was last used: its last close, else its creation */
export const lastUsed = (meta: SessionMeta): string => meta.lastClose?.at ?? meta.created

/**
 * Prune: remove the sessions of the current home last used before `olderThan` ago (all of them
 * without it). Running sessions are skipped (their lock is held), as are corrupt ones (`rm`
 * removes those by name); legacy sessions are never touched. Same lock → confirm → remove as
 * `remove`.
 */
export const prune = <E = never, R = never>(
  options: PruneOptions,
  confirm: (removals: ReadonlyArray<Removal>) => Effect.Effect<void, E, R> = () => Effect.void
) =>
  Effect.scoped(
    Effect.gen(function* () {
      const store = yield* SessionStore
      const now = yield* Clock.currentTimeMillis
      const cutoff = now - (options.olderThan === undefined ? 0 : Duration.toMillis(options.olderThan))
      const names = yield* store.listNames()
      const removals: Array<Removal> = []
      const skipped: Array<{ readonly id: string; readonly reason: string }> = []
      for (const row of yield* store.list()) {
        if (row.legacy) continue
        if (row._tag !== "Ok") {
          skipped.push({ id: row.id, reason: `unreadable (${row.error._tag}): abox rm ${row.id} removes it` })
          continue
        }
        const used = Date.parse(lastUsed(row.meta))
        if (!(used <= cutoff)) continue
        const prepared = yield* prepare(row.id, row, names).pipe(
          Effect.map((r) => Option.some(r)),
          Effect.catchTag("SessionBusy", () =>
            Effect.as(
              Effect.sync(() => skipped.push({ id: row.id, reason: "running" })),
              Option.none<Removal>()
            )
          ),
          Effect.catchTag("SessionHasForks", (error) =>
            Effect.as(
              Effect.sync(() => skipped.push({ id: row.id, reason: `has forks (${error.forks.join(", ")})` })),
              Option.none<Removal>()
            )
          )
        )
        if (Option.isSome(prepared)) removals.push(prepared.value)
      }
      const dryRun = options.dryRun === true
      if (!dryRun) {
        yield* confirm(removals)
        yield* removeAll(removals)
      }
      const result: PruneResult = { removed: removals, dryRun, skipped }
      return result
    })
  )
