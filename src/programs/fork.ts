/**
 * Fork (docs/lifecycle.md "Fork"): a new session made from another, running, suspended or
 * stopped, in about constant time. The parent's qcow2 disks become frozen layers
 * (`root.frozen-<n>.qcow2`, `repo.frozen-<n>.qcow2`, src/lib/frozenLayers.ts); parent and fork
 * each go on in an overlay of their own over them. The fork's memory is the parent's: saved
 * while the running parent is stopped (the control protocol's `fork`), or a hard link of a
 * suspended parent's state (read-only once written; restoring never writes it). It gets a new id
 * and name; its first start restores that memory and hands it a new broker CA and fresh entropy
 * (`resumed`), like any resume. Its conversation (the guest's /var/lib/abox/context.json) and
 * the repository baseline (`repo-base.raw`, a hard link) are the parent's as they were.
 *
 * A session whose frozen layers others read is removed only with `--force`, which first makes
 * each of them independent of its files (`qemu-img rebase` through a temporary copy, renamed
 * into place); `abox gc` removes frozen layers nothing reads any more.
 */
import type { CommandExecutor } from "@effect/platform/CommandExecutor"
import * as Clock from "effect/Clock"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"
// Raw node:fs: hard links and copies of a session's files.
import * as fs from "node:fs/promises"
import * as path from "node:path"
import { sessionFile, type SessionLocation } from "../domain/sessionLayout.js"
import { StateManifest } from "../domain/memoryState.js"
import { writeJsonAtomic } from "../lib/atomicFile.js"
import {
  activeDisk,
  backingChain,
  type ChainLink,
  commitFreezeStep,
  createQcow2Overlay,
  frozenLayersIn,
  frozenOf,
  type FrozenLayers,
  prepareFreeze,
  settleDisks,
  temporaryBeside,
  writingDisk,
  exists,
  io
} from "../lib/frozenLayers.js"
import { runTool } from "../lib/repoDisk.js"
import { qemuImgTool } from "../lib/rootDisk.js"
import { AboxPaths } from "../services/AboxPaths.js"
import { RuntimeLock, SessionBusy } from "../services/RuntimeLock.js"
import { SessionStore, StoreIoError } from "../services/SessionStore.js"
import * as Detached from "./detached.js"
import { type FreezeError, savedState, savedStateFiles } from "./suspend.js"

/** a fork that cannot be made (a raw root disk, a session running in a process that serves no socket) */
export class ForkRefused extends Schema.TaggedError<ForkRefused>()("ForkRefused", {
  sessionId: Schema.String,
  reason: Schema.String,
  message: Schema.String
}) {}

/** `rm` of a session whose frozen layers other sessions read (like ImageInUse for `image rm`) */
export class SessionHasForks extends Schema.TaggedError<SessionHasForks>()("SessionHasForks", {
  sessionId: Schema.String,
  forks: Schema.Array(Schema.String),
  message: Schema.String
}) {}

export interface ForkOptions {
  readonly name?: string | undefined
  /**
   * how a running parent is frozen (default: its supervisor, over the control socket); the SDK
   * passes its own open session's `freeze` for a session it holds itself
   */
  readonly freezeRunning?:
    | ((
        statePath: string
      ) => Effect.Effect<
        { readonly frozen: FrozenLayers; readonly manifest: StateManifest },
        FreezeError,
        CommandExecutor
      >)
    | undefined
}

/** `source` at `target` too: a hard link (the file is never written again), a copy across filesystems */
const share = (source: string, target: string) =>
  io(target, "link", () =>
    fs.link(source, target).catch(async (error: NodeJS.ErrnoException) => {
      if (error.code !== "EXDEV") throw error
      await fs.copyFile(source, target)
      await fs.chmod(target, 0o600)
    })
  )

/**
 * `abox fork <ref> [--name]`: the new session's metadata. A stopped or suspended parent is frozen
 * here, under its lock; a running one by its supervisor (a session held by a process that
 * serves no control socket is refused). A failure removes the half-made fork; the parent is
 * whole at every step (at worst an unused frozen layer is left, which gc removes).
 */
export const fork = Effect.fn("fork")(function* (ref: string, options: ForkOptions = {}) {
  const store = yield* SessionStore
  const lock = yield* RuntimeLock
  const paths = yield* AboxPaths
  const parent = yield* store.locate(ref)
  const meta = yield* store.get(parent.id)
  if (parent.legacy)
    return yield* new ForkRefused({
      sessionId: parent.id,
      reason: "legacy",
      message: `session ${parent.id} is in the legacy home, which abox does not write: it cannot be forked`
    })
  if (meta.rootDisk?.format !== "qcow2")
    return yield* new ForkRefused({
      sessionId: parent.id,
      reason: "disk",
      message: `session ${parent.id} has a raw root disk (${meta.rootDisk?.kind ?? "full copy"}): only sessions on qcow2 overlays can be forked`
    })
  const qemuImg = yield* qemuImgTool

  return yield* Effect.scoped(
    Effect.gen(function* () {
      const held = yield* lock.acquire(parent).pipe(Effect.either)
      if (held._tag === "Left" && held.left._tag !== "SessionBusy") return yield* held.left
      const running = held._tag === "Left"
      const child = yield* store.create({
        source: meta.source,
        model: meta.model,
        name: options.name,
        image: meta.image,
        guest: meta.guest,
        vmm: meta.vmm,
        resources: meta.resources,
        policy: meta.policy
      })
      const location: SessionLocation = { id: child.id, dir: paths.sessionDir(child.id), legacy: false }
      const dir = location.dir
      return yield* Effect.gen(function* () {
        yield* lock.acquire(location)
        const childState = savedStateFiles(dir)
        let frozen: FrozenLayers
        let manifest: StateManifest | undefined
        if (running) {
          if (options.freezeRunning !== undefined) {
            const local = yield* options.freezeRunning(childState.state)
            frozen = local.frozen
            manifest = local.manifest
          } else {
            const reply = yield* Detached.freeze(parent.id, childState.state).pipe(
              Effect.catchTag(
                "SessionNotRunning",
                () =>
                  new ForkRefused({
                    sessionId: parent.id,
                    reason: "running",
                    message: `session ${ref} is running in a process that serves no control socket (abox open): fork it when it is detached (abox start), suspended or stopped`
                  })
              )
            )
            frozen = { root: reply.root, repo: reply.repo }
            manifest = reply.manifest
          }
        } else {
          yield* settleDisks(parent.dir)
          const steps = yield* prepareFreeze(qemuImg, parent.dir, false)
          for (const step of steps) yield* commitFreezeStep(step)
          frozen = frozenOf(steps)
          const saved = yield* savedState(parent.dir).pipe(Effect.orElseSucceed(() => Option.none()))
          if (Option.isSome(saved)) {
            yield* share(savedStateFiles(parent.dir).state, childState.state)
            manifest = saved.value
          }
        }
        if (frozen.root === undefined)
          return yield* new ForkRefused({
            sessionId: parent.id,
            reason: "disk",
            message: `session ${parent.id} has no root.qcow2`
          })
        yield* createQcow2Overlay(qemuImg, frozen.root, activeDisk(dir, "root"))
        if (frozen.repo !== undefined) {
          yield* createQcow2Overlay(qemuImg, frozen.repo, activeDisk(dir, "repo"))
          yield* share(sessionFile(parent.dir, "repoBase"), sessionFile(dir, "repoBase"))
        }
        // a standalone parent boots its own kernel: so does the fork
        for (const file of ["kernel", "kernelImage", "initrd"] as const) {
          if (yield* exists(sessionFile(parent.dir, file)))
            yield* share(sessionFile(parent.dir, file), sessionFile(dir, file))
        }
        // the environment's variables carry over (resume reads them from the last config)
        const config = yield* store.readGuestConfig(parent.id).pipe(Effect.option)
        if (Option.isSome(config))
          yield* store.writeGuestConfig(child.id, { ...config.value, sessionId: child.id })
        if (manifest !== undefined) {
          const file = childState.manifest
          yield* writeJsonAtomic(file, StateManifest, manifest).pipe(
            Effect.mapError(
              (e) =>
                new StoreIoError({
                  path: file,
                  operation: "write",
                  message: `cannot write ${file}: ${e.message}`
                })
            )
          )
        }
        const now = yield* Clock.currentTimeMillis
        return yield* store.update(child.id, (current) => ({
          ...current,
          rootDisk:
            meta.rootDisk?.kind === "standalone" ? meta.rootDisk : { ...meta.rootDisk!, kind: "overlay" },
          fork: {
            parent: parent.id,
            ...(meta.name === undefined ? {} : { parentName: meta.name }),
            at: new Date(now).toISOString(),
            root: frozen.root!,
            ...(frozen.repo === undefined ? {} : { repo: frozen.repo }),
            from: running ? "running" : manifest !== undefined ? "suspended" : "stopped"
          }
        }))
      }).pipe(Effect.onError(() => Effect.ignore(store.remove(child.id))))
    })
  )
})

/** the disks a session's drives write: the active ones, and a running fork's `next` overlays */
const writtenDisks = (dir: string) =>
  Effect.gen(function* () {
    const files = new Set<string>()
    for (const drive of ["root", "repo"] as const) {
      for (const file of [activeDisk(dir, drive), yield* writingDisk(dir, drive)])
        if (yield* exists(file)) files.add(file)
    }
    return [...files]
  })

/** the qcow2 disks of a session directory: the disks it writes and its frozen layers */
const qcow2Files = (dir: string) =>
  Effect.gen(function* () {
    return [
      ...(yield* writtenDisks(dir)),
      ...(yield* frozenLayersIn(dir)).map((name) => path.join(dir, name))
    ]
  })

const inside = (dir: string, file: string) => path.dirname(path.resolve(file)) === path.resolve(dir)

/** each qcow2 file of every other session of the current home, with its backing chain */
const otherChains = (exceptId: string) =>
  Effect.gen(function* () {
    const store = yield* SessionStore
    const qemuImg = yield* qemuImgTool
    const result: Array<{
      readonly session: SessionLocation
      readonly file: string
      readonly chain: ReadonlyArray<ChainLink>
    }> = []
    for (const row of yield* store.list()) {
      if (row.legacy || row.id === exceptId) continue
      for (const file of yield* qcow2Files(row.dir)) {
        const chain = yield* backingChain(qemuImg, file).pipe(Effect.orElseSucceed(() => []))
        result.push({ session: row, file, chain })
      }
    }
    return result
  })

/** the sessions whose disks read files of `dir` (through any depth of frozen layers) */
export const forksOf = Effect.fn("fork.forksOf")(function* (session: SessionLocation) {
  const chains = yield* otherChains(session.id)
  const ids = new Set<string>()
  for (const entry of chains)
    if (entry.chain.some((link) => inside(session.dir, link.file))) ids.add(entry.session.id)
  return [...ids].sort()
})

/**
 * Every file of another session that reads through a file of `session.dir` is rebased off it:
 * onto the first file of its chain outside that directory (the golden, a grandparent's layer),
 * or, where the chain ends in the parent's `repo-base.raw`, onto its own session's (the same
 * bytes, a hard link), or onto nothing (flattened). Each through a temporary copy, synced and
 * renamed into place. The sessions must not run: their locks are taken (SessionBusy).
 */
export const detachForks = Effect.fn("fork.detach")(function* (session: SessionLocation) {
  const lock = yield* RuntimeLock
  const qemuImg = yield* qemuImgTool
  const chains = yield* otherChains(session.id)
  const affected = chains.filter((entry) => entry.chain.some((link) => inside(session.dir, link.file)))
  const locked = new Set<string>()
  for (const entry of affected) {
    if (locked.has(entry.session.id)) continue
    locked.add(entry.session.id)
    yield* lock.acquire(entry.session).pipe(
      Effect.catchTag(
        "SessionBusy",
        () =>
          new SessionBusy({
            sessionId: entry.session.id,
            message: `session ${entry.session.id} reads ${session.id}'s disks and is running: stop it first; nothing was removed`
          })
      )
    )
  }
  for (const entry of affected) {
    const own = entry.chain[0]
    if (own === undefined || own.backing === undefined || !inside(session.dir, own.backing)) continue
    const outside = entry.chain.slice(1).find((link) => !inside(session.dir, link.file))
    const last = entry.chain.at(-1)!
    const ownBase = sessionFile(entry.session.dir, "repoBase")
    const target =
      outside !== undefined
        ? { file: outside.file, format: outside.format }
        : path.basename(last.file) === path.basename(ownBase) && (yield* exists(ownBase))
          ? { file: ownBase, format: "raw" }
          : undefined
    const temp = temporaryBeside(entry.file)
    const cleanup = Effect.promise(() => fs.rm(temp, { force: true }))
    yield* Effect.gen(function* () {
      yield* io(temp, "copy", () => fs.copyFile(entry.file, temp))
      yield* io(temp, "chmod", () => fs.chmod(temp, 0o600))
      yield* runTool(
        temp,
        qemuImg,
        target === undefined
          ? ["rebase", "-q", "-f", "qcow2", "-b", "", temp]
          : ["rebase", "-q", "-f", "qcow2", "-b", target.file, "-F", target.format, temp]
      )
      yield* io(temp, "fsync", async () => {
        const handle = await fs.open(temp, "r")
        try {
          await handle.sync()
        } finally {
          await handle.close()
        }
      })
      yield* io(entry.file, "rename", () => fs.rename(temp, entry.file))
    }).pipe(Effect.tapError(() => cleanup))
  }
  return [...locked].sort()
})

/**
 * The frozen layers nothing reads any more (no session's active disk has them in its chain),
 * in sessions whose lock is free; `abox gc` removes them.
 */
export const unusedFrozenLayers = Effect.fn("fork.unusedLayers")(function* () {
  const store = yield* SessionStore
  const rows = (yield* store.list()).filter((row) => !row.legacy)
  const candidates: Array<{ readonly session: SessionLocation; readonly file: string }> = []
  for (const row of rows)
    for (const name of yield* frozenLayersIn(row.dir))
      candidates.push({ session: row, file: path.join(row.dir, name) })
  // no frozen layer anywhere (no fork was ever made): no qemu-img run
  if (candidates.length === 0) return []
  const qemuImg = yield* qemuImgTool
  const used = new Set<string>()
  for (const row of rows) {
    for (const file of yield* writtenDisks(row.dir)) {
      const chain = yield* backingChain(qemuImg, file).pipe(Effect.orElseSucceed(() => undefined))
      // a chain that cannot be read: keep everything (never remove what may be read)
      if (chain === undefined) return []
      for (const link of chain) used.add(link.file)
    }
  }
  return candidates.filter((c) => !used.has(path.resolve(c.file)))
})
