import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
// Raw node:fs: /proc is read as plain files, and a lock probe needs no more than a scope.
import * as fs from "node:fs/promises"
import * as path from "node:path"
import { AboxPaths } from "../services/AboxPaths.js"
import { RuntimeLock } from "../services/RuntimeLock.js"
import { SessionStore, StoreIoError } from "../services/SessionStore.js"
import { errorMessage } from "../domain/errorMessage.js"
import { unusedFrozenLayers } from "./fork.js"

export interface GcAction {
  readonly kind: "socket" | "temp-file" | "dangling-name" | "orphan-vmm" | "frozen-layer"
  readonly target: string
  readonly detail: string
  readonly done: boolean
}

/** a VMM process of ours: its argv names a root disk under our sessions directory */
interface VmmProcess {
  readonly pid: number
  readonly sessionId: string
  readonly helperPid: number | undefined
}

const readText = (file: string) =>
  Effect.promise(() =>
    fs.readFile(file, "utf8").then(
      (text) => Option.some(text),
      () => Option.none<string>()
    )
  )

/**
 * Processes whose command line proves they are ours: a qemu-system-* or vfkit whose disk
 * argument is `<sessions>/<id>/root.raw` (or `root.qcow2`), and (its parent) an abox-vmm helper. Linux only:
 * elsewhere there is no /proc and the scan finds nothing.
 */
const findVmmProcesses = (sessionsDir: string) =>
  Effect.gen(function* () {
    const entries = yield* Effect.promise(() => fs.readdir("/proc").catch(() => [] as Array<string>))
    const found: Array<VmmProcess> = []
    const marker = new RegExp(
      `${sessionsDir.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")}/([0-9a-z]+)/root\\.(?:raw|qcow2)`
    )
    for (const entry of entries) {
      if (!/^\d+$/.test(entry)) continue
      const cmdline = yield* readText(`/proc/${entry}/cmdline`)
      if (Option.isNone(cmdline)) continue
      const argv = cmdline.value.split("\0")
      if (!/(qemu-system-|vfkit)/.test(path.basename(argv[0] ?? ""))) continue
      const match = argv.join(" ").match(marker)
      if (match === null) continue
      const status = yield* readText(`/proc/${entry}/status`)
      const ppid = Option.flatMap(status, (s) => Option.fromNullable(s.match(/^PPid:\s+(\d+)/m)?.[1]))
      let helperPid: number | undefined
      if (Option.isSome(ppid)) {
        const parent = yield* readText(`/proc/${ppid.value}/cmdline`)
        if (Option.isSome(parent) && parent.value.includes("abox-vmm")) helperPid = Number(ppid.value)
      }
      found.push({ pid: Number(entry), sessionId: match[1]!, helperPid })
    }
    return found
  })

const exists = (file: string) =>
  Effect.promise(() =>
    fs.access(file).then(
      () => true,
      () => false
    )
  )

/**
 * `abox gc`: what a crash can leave behind, and nothing a user made. Sockets of sessions whose
 * lock is free (no VM runs them), temp files of interrupted atomic writes, names bound to
 * sessions that are gone, and VMM processes (and their helpers) whose session directory is gone.
 * Sessions themselves are never removed, and neither is an image: a golden is the backing file
 * of its sessions' overlays (`abox image rm` is the one way an image goes, docs/on-disk.md).
 */
export const gc = Effect.fn("gc")(function* (options: { readonly dryRun: boolean }) {
  const store = yield* SessionStore
  const lock = yield* RuntimeLock
  const paths = yield* AboxPaths
  const actions: Array<GcAction> = []
  const act = <E>(kind: GcAction["kind"], target: string, detail: string, run: Effect.Effect<void, E>) =>
    Effect.gen(function* () {
      if (!options.dryRun) yield* run
      actions.push({ kind, target, detail, done: !options.dryRun })
    })
  const removeFile = (file: string) =>
    Effect.tryPromise({
      try: () => fs.rm(file, { force: true }),
      catch: (cause) =>
        new StoreIoError({
          path: file,
          operation: "remove",
          message: `cannot remove ${file}: ${errorMessage(cause)}`
        })
    })

  const rows = yield* store.list()
  for (const row of rows) {
    if (row.legacy) continue // the legacy home is read-only
    const files = yield* Effect.promise(() => fs.readdir(row.dir).catch(() => [] as Array<string>))
    const sockets = files.filter((f) => f.endsWith(".sock"))
    const temps = files.filter((f) => f.startsWith(".") && f.includes(".tmp-"))
    if (sockets.length === 0 && temps.length === 0) continue
    // only when nobody holds the session: a running VM's sockets and writes are its own
    const free = yield* Effect.scoped(lock.acquire(row)).pipe(
      Effect.as(true),
      Effect.orElseSucceed(() => false)
    )
    if (!free) continue
    for (const socket of sockets) {
      yield* act(
        "socket",
        path.join(row.dir, socket),
        "no VM runs this session",
        removeFile(path.join(row.dir, socket))
      )
    }
    for (const temp of temps) {
      yield* act(
        "temp-file",
        path.join(row.dir, temp),
        "left by an interrupted write",
        removeFile(path.join(row.dir, temp))
      )
    }
  }

  // frozen layers no disk reads any more (their forks removed or made independent): removed
  // under their session's lock, so no fork of it is being made meanwhile
  const unused = yield* unusedFrozenLayers().pipe(Effect.orElseSucceed(() => []))
  for (const layer of unused) {
    yield* Effect.scoped(
      Effect.gen(function* () {
        const held = yield* Effect.either(lock.acquire(layer.session))
        if (held._tag === "Left") return
        yield* act("frozen-layer", layer.file, "a frozen layer no session's disk reads", removeFile(layer.file))
      })
    )
  }

  for (const binding of yield* store.listNames()) {
    if (yield* exists(paths.sessionDir(binding.sessionId))) continue
    yield* act(
      "dangling-name",
      binding.name,
      `bound to ${binding.sessionId}, which is gone`,
      store.unbindName(binding.name).pipe(Effect.ignore)
    )
  }

  for (const vmm of yield* findVmmProcesses(paths.sessions)) {
    if (yield* exists(paths.sessionDir(vmm.sessionId))) continue
    const stop = Effect.sync(() => {
      for (const pid of [vmm.helperPid, vmm.pid]) {
        if (pid === undefined) continue
        try {
          process.kill(pid, "SIGTERM")
        } catch {
          // already gone
        }
      }
    })
    yield* act(
      "orphan-vmm",
      `pid ${vmm.pid}${vmm.helperPid !== undefined ? ` (helper ${vmm.helperPid})` : ""}`,
      `runs session ${vmm.sessionId}, whose directory is gone`,
      stop
    )
  }
  return actions
})
