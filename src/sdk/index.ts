/**
 * The abox SDK. Two faces over the same programs:
 *
 * - Promise: `await using session = await open({ source })`, then
 *   `for await (const event of session.turn("make test"))`; `SessionManager` for those who
 *   think in names (seed 001: start / connect / list / stop).
 * - Effect: `Abox.open` / `Abox.resume` are the programs themselves (scoped sessions, typed
 *   errors), with `Abox.layer` providing every service.
 *
 * Errors are the same tagged errors the CLI prints (`_tag`, `message`, fields); see
 * docs/exit-codes.md. The SDK never writes transcript.json (the CLI's interactive mode does).
 */
import * as Cause from "effect/Cause"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import type * as Layer from "effect/Layer"
import * as ManagedRuntime from "effect/ManagedRuntime"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import { AboxLive } from "../layers/Main.js"
import { idleTimeout, type IdleTracker } from "../programs/idle.js"
import * as Remove from "../programs/remove.js"
import * as Programs from "../programs/session.js"
import type { HelloMessage } from "../protocol/Messages.js"
import type { TurnEvent } from "../services/GuestRpc.js"
import { SecretScrubber } from "../services/SecretScrubber.js"
import {
  SessionStore,
  type NameBinding,
  type SessionListing,
  type SessionMeta
} from "../services/SessionStore.js"

export type { BootOptions, OpenOptions, Phase, Session } from "../programs/session.js"
export type { AgentEvent, HelloMessage } from "../protocol/Messages.js"
export type { TurnEvent, TurnResult } from "../services/GuestRpc.js"
export type { NameBinding, SessionListing, SessionMeta } from "../services/SessionStore.js"
export type { ScrubReport } from "../services/SecretScrubber.js"
export {
  SessionNotFound,
  SessionCorrupt,
  SessionFormatTooNew,
  NameTaken,
  InvalidName,
  StoreIoError
} from "../services/SessionStore.js"
export { SessionBusy, LockError } from "../services/RuntimeLock.js"
export {
  GuestTooOld,
  GuestTooNew,
  ProtocolError,
  GuestTimeout,
  GuestDisconnected,
  TransferFailed
} from "../services/GuestRpc.js"
export { VmmError, VmmUnavailable } from "../services/VmmBackend.js"
export { ImageNotFound, DiskError } from "../services/Images.js"
export { SessionIncompatible } from "../programs/compat.js"
export { InvalidOption } from "../programs/session.js"
export { SourceInvalid } from "../lib/snapshot.js"
export { ConfigInvalid } from "../lib/env.js"

/** The Effect API: the programs, and the layer that provides what they need. */
export const Abox = {
  open: Programs.open,
  resume: Programs.resume,
  layer: AboxLive
} as const

// ---- Promise facade ----

type AboxContext = Layer.Layer.Success<typeof AboxLive>
const makeRuntime = () => ManagedRuntime.make(AboxLive)
let runtime: ReturnType<typeof makeRuntime> | undefined
let scrubbed: Promise<unknown> | undefined

/** one runtime per process; the secret scrub runs once, on the SDK's first use (DESIGN: on every start) */
const getRuntime = async () => {
  runtime ??= makeRuntime()
  scrubbed ??= runtime.runPromise(
    Effect.flatMap(SecretScrubber, (scrubber) => scrubber.scrub({ dryRun: false })).pipe(Effect.ignore)
  )
  await scrubbed
  return runtime
}

/** run an Effect; a failure rejects with the typed error itself (not a wrapper) */
const run = async <A, E>(effect: Effect.Effect<A, E, AboxContext>): Promise<A> => {
  const rt = await getRuntime()
  const exit = await rt.runPromiseExit(effect)
  if (Exit.isSuccess(exit)) return exit.value
  throw Cause.squash(exit.cause)
}

export interface TurnOutcome {
  readonly exitCode: number | null
  readonly signal: string | null
  readonly cancelled: boolean
  readonly stdout: string
  readonly stderr: string
  readonly events: ReadonlyArray<TurnEvent>
}

/** An open session. Close it (`await session.close()`, or `await using`): a leaked session leaves a VM. */
export interface SessionHandle extends AsyncDisposable {
  readonly id: string
  readonly dir: string
  readonly meta: SessionMeta
  readonly hello: HelloMessage
  readonly skipped: ReadonlyArray<string>
  /** the turn's events as they come; leaving the loop early cancels the turn */
  turn(text: string): AsyncIterable<TurnEvent>
  /** a whole turn, collected */
  run(text: string): Promise<TurnOutcome>
  /** Close: shutdown RPC → bounded stop of the VM → unlock. Idempotent. */
  close(): Promise<void>
  readonly closed: boolean
}

const handleFor = async (
  acquire: Effect.Effect<Programs.Session, unknown, AboxContext | Scope.Scope>
): Promise<SessionHandle> => {
  const rt = await getRuntime()
  const scope = await run(Scope.make())
  let session: Programs.Session
  try {
    session = await run(Scope.extend(acquire, scope))
  } catch (error) {
    await run(Scope.close(scope, Exit.void))
    throw error
  }
  let closing: Promise<void> | undefined
  const close = () => (closing ??= run(Scope.close(scope, Exit.void)))
  const iterate = (text: string): AsyncIterable<TurnEvent> => ({
    [Symbol.asyncIterator]: () => {
      let iterator: AsyncIterator<TurnEvent> | undefined
      const start = async () =>
        (iterator ??= Stream.toAsyncIterableRuntime(session.turn(text), await rt.runtime())[
          Symbol.asyncIterator
        ]())
      return {
        next: async () => (await start()).next(),
        return: async (value?: unknown) => {
          const it = await start()
          return it.return ? it.return(value) : { done: true, value: undefined }
        }
      }
    }
  })
  const handle: SessionHandle = {
    id: session.id,
    dir: session.dir,
    meta: session.meta,
    hello: session.hello,
    skipped: session.skipped,
    turn: iterate,
    run: async (text) => {
      const events: Array<TurnEvent> = []
      let stdout = ""
      let stderr = ""
      for await (const event of iterate(text)) {
        events.push(event)
        if (event._tag === "Event" && event.event.kind === "stdout") stdout += event.event.data
        if (event._tag === "Event" && event.event.kind === "stderr") stderr += event.event.data
      }
      const end = events.at(-1)
      return end !== undefined && end._tag === "End"
        ? { exitCode: end.exitCode, signal: end.signal, cancelled: end.cancelled, stdout, stderr, events }
        : { exitCode: null, signal: null, cancelled: true, stdout, stderr, events }
    },
    close,
    get closed() {
      return closing !== undefined
    },
    [Symbol.asyncDispose]: close
  }
  return handle
}

/** Open: a new session on `options.source` (snapshot → clone golden → boot → transfer). */
export const open = (options: Programs.OpenOptions): Promise<SessionHandle> =>
  handleFor(Programs.open(options))

/** Resume a session by id or bound name; never copies the source again. */
export const resume = (ref: string, options: Programs.BootOptions = {}): Promise<SessionHandle> =>
  handleFor(Programs.resume(ref, options))

/** every session in the current and legacy homes (corrupt ones with the reason) */
export const list = (): Promise<ReadonlyArray<SessionListing>> =>
  run(Effect.flatMap(SessionStore, (store) => store.list()))

/**
 * Remove a session (its directory and names) or a dangling name, as `abox rm --yes` does
 * (explicit only: abox never deletes a session by itself). A running session is refused with
 * `SessionBusy` and nothing is deleted.
 */
export const remove = (ref: string): Promise<void> => run(Effect.asVoid(Remove.remove([ref])))

// ---- seed 001: sessions by name ----

export interface StartOptions extends Omit<Programs.OpenOptions, "name"> {
  /** close the session after this many seconds without a turn (default: never) */
  readonly timeout?: number | undefined
}

export interface NamedSession extends NameBinding {
  /** open in this manager right now */
  readonly running: boolean
}

/**
 * Sessions by human name (seed 001): `start(name, { source, image, timeout })` opens a session
 * bound to the name; `connect(name)` returns the open one or resumes it; `list()`; `stop(name)`
 * closes it (the session stays on disk).
 */
export class SessionManager {
  readonly #open = new Map<string, { readonly handle: SessionHandle; readonly touch: () => void }>()

  async start(name: string, options: StartOptions): Promise<SessionHandle> {
    const { timeout, ...openOptions } = options
    return await this.#track(name, await open({ ...openOptions, name }), timeout)
  }

  async connect(
    name: string,
    options: Programs.BootOptions & { readonly timeout?: number } = {}
  ): Promise<SessionHandle> {
    const held = this.#open.get(name)
    if (held !== undefined && !held.handle.closed) {
      held.touch()
      return held.handle
    }
    const { timeout, ...bootOptions } = options
    return await this.#track(name, await resume(name, bootOptions), timeout)
  }

  async list(): Promise<ReadonlyArray<NamedSession>> {
    const names = await run(Effect.flatMap(SessionStore, (store) => store.listNames()))
    return names.map((binding) => ({
      ...binding,
      running: this.#open.get(binding.name)?.handle.closed === false
    }))
  }

  /** close the named session if this manager has it open; false if it was not running here */
  async stop(name: string): Promise<boolean> {
    await run(Effect.flatMap(SessionStore, (store) => store.lookupName(name)))
    const held = this.#open.get(name)
    this.#open.delete(name)
    if (held === undefined || held.handle.closed) return false
    await held.handle.close()
    return true
  }

  /** close every session this manager holds */
  async stopAll(): Promise<void> {
    await Promise.all([...this.#open.keys()].map((name) => this.stop(name)))
  }

  async #track(name: string, handle: SessionHandle, timeout: number | undefined): Promise<SessionHandle> {
    // the idle timeout is the Effect program's (Clock-driven); the facade only reports activity
    const idle =
      timeout === undefined
        ? undefined
        : await run(
            Effect.gen(function* () {
              const scope = yield* Scope.make()
              const tracker = yield* idleTimeout(
                Duration.seconds(timeout),
                // fire and forget: the close must not wait on the timer fiber it ends
                Effect.sync(() => void closeQuietly())
              ).pipe(Scope.extend(scope))
              return { scope, tracker }
            })
          )
    const activity = (effect: (tracker: IdleTracker) => Effect.Effect<void>) =>
      idle === undefined ? Promise.resolve() : run(effect(idle.tracker))
    const stopTimer = () => (idle === undefined ? Promise.resolve() : run(Scope.close(idle.scope, Exit.void)))
    const close = async () => {
      await stopTimer()
      await handle.close()
    }
    const closeQuietly = () => this.stop(name).catch(() => undefined)
    const tracked: SessionHandle = {
      ...handle,
      get closed() {
        return handle.closed
      },
      turn: (text) => {
        const events = handle.turn(text)
        return {
          [Symbol.asyncIterator]: () => {
            const begun = activity((t) => t.begin)
            const it = events[Symbol.asyncIterator]()
            // once per turn, however it ends (done, left early, or a rejected next())
            let ended = false
            const done = async () => {
              if (ended) return
              ended = true
              await begun
              await activity((t) => t.end)
            }
            return {
              next: async () => {
                try {
                  const r = await it.next()
                  if (r.done === true) await done()
                  return r
                } catch (error) {
                  await done()
                  throw error
                }
              },
              return: async (value?: unknown) => {
                await done()
                return it.return ? it.return(value) : { done: true, value: undefined }
              }
            }
          }
        }
      },
      run: async (text) => {
        await activity((t) => t.begin)
        try {
          return await handle.run(text)
        } finally {
          await activity((t) => t.end)
        }
      },
      close,
      [Symbol.asyncDispose]: close
    }
    this.#open.set(name, { handle: tracked, touch: () => void activity((t) => t.touch) })
    return tracked
  }
}

/** release the SDK's runtime (tests, short scripts); open sessions should be closed first */
export const dispose = async (): Promise<void> => {
  const rt = runtime
  runtime = undefined
  scrubbed = undefined
  if (rt !== undefined) await rt.dispose()
}
