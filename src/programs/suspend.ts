/**
 * Suspend and resume with memory (docs/lifecycle.md "Suspend"): a session's VM saved to
 * `memory.state` + `memory.json` beside its disks and ended; the next boot of the session
 * restores it instead (its processes go on) when the state still fits, and cold-boots from the
 * disks otherwise, saying why. A state is used once: once the restored VM runs, its disks move on
 * and the state no longer matches them, so it is removed.
 */
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import type * as Scope from "effect/Scope"
import * as fs from "node:fs"
import { writeJsonAtomic } from "../lib/atomicFile.js"
import { sessionFile } from "../domain/sessionLayout.js"
import {
  SnapshotUnsupported,
  StateManifest,
  StateMismatch,
  SuspendRefused
} from "../domain/memoryState.js"
import type { VmHandle, VmmError, VmSpec } from "../domain/vm.js"
import { FEATURE_RESUME, type HelloMessage } from "../protocol/Messages.js"
import type { VmmBackendShape } from "../services/VmmBackend.js"
import { readManifest } from "../vmm/migration.js"
import { StoreIoError } from "../services/SessionStore.js"
import type { DiskError } from "../domain/image.js"
import { abandonFreeze, frozenOf, type FrozenLayers, prepareFreeze } from "../lib/frozenLayers.js"
import { qemuImgTool } from "../lib/rootDisk.js"

export { SuspendRefused }

export type SuspendError = SuspendRefused | SnapshotUnsupported | VmmError | StoreIoError

/** a session's state files */
export const savedStateFiles = (dir: string) => ({
  state: sessionFile(dir, "memoryState"),
  manifest: sessionFile(dir, "memoryManifest")
})

/** the manifest of a complete saved state (both files there), if the session has one */
export const savedState = (dir: string): Effect.Effect<Option.Option<StateManifest>, StateMismatch> =>
  Effect.suspend(() => {
    const files = savedStateFiles(dir)
    if (!fs.existsSync(files.manifest)) return Effect.succeedNone
    if (!fs.existsSync(files.state))
      return Effect.fail(new StateMismatch({ field: "state", message: `${files.state} is missing` }))
    return Effect.map(readManifest(files.manifest), Option.some)
  })

/** the state's size on disk, for `show` (absent: not suspended) */
export const savedStateBytes = (dir: string): number | undefined => {
  const files = savedStateFiles(dir)
  try {
    if (!fs.existsSync(files.manifest)) return undefined
    const stat = fs.statSync(files.state)
    return Math.min(stat.size, stat.blocks * 512)
  } catch {
    return undefined
  }
}

/** remove a session's state (the manifest first: a state without one is never used) */
export const discardSavedState = (dir: string): Effect.Effect<void> =>
  Effect.sync(() => {
    const files = savedStateFiles(dir)
    fs.rmSync(files.manifest, { force: true })
    fs.rmSync(files.state, { force: true })
  })

/** a guest that can be restored (resume feature), on a backend that can save its memory */
const checkSavable = (vm: VmHandle, hello: HelloMessage) =>
  Effect.gen(function* () {
    if (hello.features?.includes(FEATURE_RESUME) !== true) {
      return yield* new SuspendRefused({
        reason: "guest",
        message:
          "this session's guest predates suspend (no resume feature): run image-update and open a new session"
      })
    }
    if (vm.saveState === undefined) {
      return yield* new SnapshotUnsupported({
        backend: vm.backend,
        message: `the ${vm.backend} backend cannot save a VM's memory`
      })
    }
    return vm.saveState
  })

export type FreezeError = SuspendError | DiskError

/** what a running session's freeze made: its frozen layers and the memory saved at that moment */
export interface Frozen {
  readonly frozen: FrozenLayers
  readonly manifest: StateManifest
}

/**
 * A fork of a running session (src/programs/fork.ts): while the VM is stopped its disks become
 * frozen layers, it goes on in new overlays over them, and its memory is saved into `statePath`
 * (the fork's); then it runs on. Only an idle guest that understands `resumed`.
 */
export const freezeVm = Effect.fn("suspend.freeze")(function* (
  vm: VmHandle,
  hello: HelloMessage,
  dir: string,
  imageDigest: string,
  statePath: string
) {
  const saveState = yield* checkSavable(vm, hello)
  const steps = yield* prepareFreeze(yield* qemuImgTool, dir, true)
  const manifest = yield* saveState({
    statePath,
    then: "cont",
    imageDigest,
    snapshotDisks: steps.map((step) => ({ drive: step.drive, overlay: step.next }))
  }).pipe(Effect.tapError(() => abandonFreeze(steps)))
  return { frozen: frozenOf(steps), manifest } satisfies Frozen
})

/**
 * Save the running VM's memory into the session directory and end the VM (it quits; the
 * caller's scope then closes the session as usual). Only an idle guest that understands
 * `resumed` is saved; the manifest is written last.
 */
export const suspendVm = Effect.fn("suspend.save")(function* (
  vm: VmHandle,
  hello: HelloMessage,
  dir: string,
  imageDigest: string
) {
  const saveState = yield* checkSavable(vm, hello)
  const files = savedStateFiles(dir)
  yield* discardSavedState(dir)
  const manifest = yield* saveState({ statePath: files.state, then: "quit", imageDigest })
  yield* writeJsonAtomic(files.manifest, StateManifest, manifest).pipe(
    Effect.mapError(
      (e) =>
        new StoreIoError({
          path: files.manifest,
          operation: "write",
          message: `cannot write ${files.manifest}: ${e.message}`
        })
    )
  )
  return manifest
})

/**
 * Boot's first try: restore the session's saved state when it has one that fits. Whatever the
 * outcome the state is removed (restored: the disks move on from it; refused: it never fits).
 * None (with the reason told to `note`): boot the VM instead.
 */
export const restoreSaved = (
  vmm: VmmBackendShape,
  spec: VmSpec,
  imageDigest: string,
  note: (message: string) => Effect.Effect<void>
): Effect.Effect<Option.Option<VmHandle>, never, Scope.Scope> =>
  Effect.gen(function* () {
    const attempt = Effect.gen(function* () {
      const saved = yield* savedState(spec.sessionDir)
      if (Option.isNone(saved)) return Option.none<VmHandle>()
      if (vmm.restore === undefined) {
        return yield* new SnapshotUnsupported({
          backend: vmm.name,
          message: `the ${vmm.name} backend cannot restore a VM's memory`
        })
      }
      const state = { statePath: savedStateFiles(spec.sessionDir).state, manifest: saved.value, imageDigest }
      const restore = vmm.restore
      return Option.some(
        yield* restore(spec, state).pipe(
          // a session opened warm was saved in the warm layout, its repository disks in their slots
          Effect.catchTag("StateMismatch", (mismatch) =>
            mismatch.field === "layoutDigest" && vmm.warm !== undefined && spec.repoDisks !== undefined
              ? restore({ ...spec, warm: true, plugged: true }, state)
              : Effect.fail(mismatch)
          )
        )
      )
    })
    const restored = yield* Effect.either(attempt)
    if (restored._tag === "Right" && Option.isNone(restored.right)) return Option.none()
    yield* discardSavedState(spec.sessionDir)
    if (restored._tag === "Right") return restored.right
    yield* note(
      `the saved memory state was not used, the session boots from its disks: ${restored.left.message}`
    )
    return Option.none()
  })
