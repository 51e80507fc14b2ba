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
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as path from "node:path"
import { AboxLive } from "../layers/Main.js"
import * as Repo from "../programs/repo.js"
import * as Detached from "../programs/detached.js"
import * as Environment from "../programs/environment.js"
import { idleTimeout, type IdleTracker } from "../programs/idle.js"
import * as Remove from "../programs/remove.js"
import * as Fork from "../programs/fork.js"
import {
  ControlError,
  ControlRefused,
  ControlVersionMismatch,
  SessionNotRunning
} from "../protocol/Control.js"
import * as Programs from "../programs/session.js"
import type { AgentEvent, HelloMessage, TurnLimits } from "../protocol/Messages.js"
import type { TurnEvent } from "../services/GuestRpc.js"
import type { SessionContract } from "../services/Session.js"
import { SecretScrubber } from "../services/SecretScrubber.js"
import {
  SessionStore,
  type NameBinding,
  type SessionListing,
  type SessionMeta
} from "../services/SessionStore.js"

export type { BootOptions, OpenOptions, Phase, Session } from "../programs/session.js"
export type { AgentEvent, HelloMessage } from "../protocol/Messages.js"
export type { ModelSpec } from "../protocol/GuestConfig.js"
export type { TurnMode } from "../programs/session.js"
export { ModelCatalogError } from "../lib/models.js"

/** the model agent's events (a prompt turn), one type per kind */
export type TextEvent = Extract<AgentEvent, { kind: "text" }>
export type ToolCallEvent = Extract<AgentEvent, { kind: "tool_call" }>
export type ToolResultEvent = Extract<AgentEvent, { kind: "tool_result" }>
export type UsageEvent = Extract<AgentEvent, { kind: "usage" }>
export type RetryEvent = Extract<AgentEvent, { kind: "retry" }>
export type AgentEndEvent = Extract<AgentEvent, { kind: "agent_end" }>

/**
 * options of one turn: `mode: "prompt"` asks the model agent; default a shell command. A prompt
 * turn may set its own limits: `maxSteps` (model requests) and `maxCostUsd` (US dollars, from
 * the usage and the model catalog's prices); reaching one ends the turn with `agent_end`
 * `reason: "max_steps"` or `"max_cost"`. Limits the session cannot honour (a shell turn, an
 * older guest, a model without prices) end the turn at once with `agent_end` `reason: "error"`.
 */
export interface TurnOptions {
  readonly mode?: Programs.TurnMode
  readonly maxSteps?: number
  readonly maxCostUsd?: number
}

const limitsOf = (options: TurnOptions | undefined): TurnLimits | undefined =>
  options?.maxSteps === undefined && options?.maxCostUsd === undefined
    ? undefined
    : {
        ...(options.maxSteps === undefined ? {} : { maxSteps: options.maxSteps }),
        ...(options.maxCostUsd === undefined ? {} : { maxCostUsd: options.maxCostUsd })
      }
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
  GuestDisconnected
} from "../services/GuestRpc.js"
export { TransferFailed } from "../domain/transfer.js"
export { VmmError, VmmUnavailable } from "../domain/vm.js"
export { ImageNotFound, DiskError } from "../domain/image.js"
export {
  EnvironmentInvalid,
  EnvironmentSetupFailed,
  EnvironmentInstallFailed
} from "../domain/environment.js"
export { SessionIncompatible } from "../programs/compat.js"
export { InvalidOption } from "../programs/session.js"
export { SourceInvalid } from "../lib/snapshot.js"
export { ConfigInvalid } from "../lib/env.js"
export {
  ArchiveRefused,
  SourceChanged,
  MergeConflicts,
  PatchFailed,
  RepoPathInvalid,
  RepoToolFailed
} from "../domain/repoErrors.js"
export type { DiffOptions, ApplyOptions, RepoEntry } from "../programs/repo.js"
export type { TransferProgress } from "../programs/session.js"

/** The Effect API: the programs, and the layer that provides what they need. */
export const Abox = {
  /** Open, with the repository's environment unless `image` names one (docs/environments.md) */
  open: Environment.openWithEnvironment,
  resume: Programs.resume,
  /** the repository operations on a session's connection (`session.connection`) */
  diff: Repo.diff,
  apply: Repo.apply,
  files: {
    read: Repo.readFile,
    write: Repo.writeFile,
    list: Repo.listFiles,
    copyOut: Repo.copyOut,
    copyIn: Repo.copyIn
  },
  /** a stopped session: boots it, runs the operation on its connection, closes it */
  withConnection: Repo.withConnection,
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
  /** exactly the bytes the turn wrote to stdout (`stdout` is their text, lossy when not UTF-8) */
  readonly stdoutBytes: Uint8Array
  readonly stderrBytes: Uint8Array
  readonly events: ReadonlyArray<TurnEvent>
  /** a prompt turn: the assistant's answer (its text deltas joined) */
  readonly answer: string
  /** a prompt turn: its `agent_end` (why it stopped) */
  readonly agentEnd?: AgentEndEvent | undefined
}

/** An open session. Close it (`await session.close()`, or `await using`): a leaked session leaves a VM. */
export interface SessionHandle extends AsyncDisposable {
  readonly id: string
  readonly dir: string
  readonly meta: SessionMeta
  readonly hello: HelloMessage
  readonly skipped: ReadonlyArray<string>
  /** the turn's events as they come; leaving the loop early cancels the turn */
  turn(text: string, options?: TurnOptions): AsyncIterable<TurnEvent>
  /** a whole turn, collected */
  run(text: string, options?: TurnOptions): Promise<TurnOutcome>
  /** Close: shutdown RPC → bounded stop of the VM → unlock. Idempotent. */
  close(): Promise<void>
  readonly closed: boolean
  /** the changes since Open as a git patch (or `--stat` with `{ stat: true }`) */
  diff(options?: Repo.DiffOptions): Promise<string>
  /** applies the changes to a host directory (default: the source); SourceChanged if it changed there */
  apply(options?: Partial<Repo.ApplyOptions>): Promise<ReadonlyArray<string>>
  /** the repository's files (paths relative to /work/repo); written files belong to the repository user */
  readonly files: SessionFiles
  /**
   * a new session forked from this one as it is now (`abox fork`): its metadata; `resume(meta.id)`
   * (or its name) starts it, with this session's memory, processes and files
   */
  fork(options?: { readonly name?: string | undefined }): Promise<SessionMeta>
}

export interface SessionFiles {
  read(path: string): Promise<Uint8Array>
  write(path: string, data: Uint8Array | string, mode?: number): Promise<void>
  list(path?: string): Promise<ReadonlyArray<Repo.RepoEntry>>
  /** a file or directory of the session to a host path (a new name, or into a directory) */
  copyOut(guestPath: string, hostPath: string): Promise<void>
  /** a host file or directory into a directory of the session */
  copyIn(hostPath: string, guestDir: string): Promise<void>
}

/** a turn's stream as an async iterable; leaving the loop early interrupts the stream (cancels the turn) */
const iterableOf = (
  make: () => Stream.Stream<TurnEvent, unknown, AboxContext>
): AsyncIterable<TurnEvent> => ({
  [Symbol.asyncIterator]: () => {
    let iterator: AsyncIterator<TurnEvent> | undefined
    const start = async () =>
      (iterator ??= Stream.toAsyncIterableRuntime(make(), await (await getRuntime()).runtime())[
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

/** a whole turn, collected */
const collectTurn = async (events: AsyncIterable<TurnEvent>): Promise<TurnOutcome> => {
  const all: Array<TurnEvent> = []
  let stdout = ""
  let stderr = ""
  let answer = ""
  let agentEnd: AgentEndEvent | undefined
  const out: Array<Uint8Array> = []
  const err: Array<Uint8Array> = []
  for await (const event of events) {
    all.push(event)
    if (event._tag !== "Event") continue
    if (event.event.kind === "stdout") {
      stdout += event.event.data
      if (event.bytes !== undefined) out.push(event.bytes)
    }
    if (event.event.kind === "stderr") {
      stderr += event.event.data
      if (event.bytes !== undefined) err.push(event.bytes)
    }
    if (event.event.kind === "text") answer += event.event.delta
    if (event.event.kind === "agent_end") agentEnd = event.event
  }
  const output = { stdout, stderr, stdoutBytes: Buffer.concat(out), stderrBytes: Buffer.concat(err) }
  const end = all.at(-1)
  const agent = { answer, ...(agentEnd === undefined ? {} : { agentEnd }) }
  return end !== undefined && end._tag === "End"
    ? {
        exitCode: end.exitCode,
        signal: end.signal,
        cancelled: end.cancelled,
        ...output,
        events: all,
        ...agent
      }
    : { exitCode: null, signal: null, cancelled: true, ...output, events: all, ...agent }
}

/** what a handle shows of its session */
interface HandleInfo {
  readonly id: string
  readonly dir: string
  readonly meta: SessionMeta
  readonly hello: HelloMessage
  readonly skipped: ReadonlyArray<string>
}

/**
 * A handle over a Session, whichever side holds it (this process, or a supervisor through the
 * control socket): its turns and repository operations are the contract's, `close` is the
 * holder's.
 */
const handleOf = (
  info: HandleInfo,
  session: SessionContract<unknown, AboxContext>,
  lifecycle: {
    readonly close: () => Promise<void>
    readonly closed: () => boolean
    readonly fork: SessionHandle["fork"]
  }
): SessionHandle => {
  const iterate = (text: string, options?: TurnOptions): AsyncIterable<TurnEvent> => {
    if (lifecycle.closed()) throw new Error(`session handle ${info.id} is closed`)
    return iterableOf(() => session.turn(text, options?.mode ?? "shell", limitsOf(options)))
  }
  return {
    ...info,
    turn: iterate,
    run: (text, options) => collectTurn(iterate(text, options)),
    close: lifecycle.close,
    fork: lifecycle.fork,
    get closed() {
      return lifecycle.closed()
    },
    [Symbol.asyncDispose]: lifecycle.close,
    diff: (options) => run(session.diff(options)),
    apply: (options) => run(session.apply({ ...options, to: options?.to ?? info.meta.source })),
    files: {
      read: (path) => run(session.readFile(path)),
      write: (path, data, mode) => run(Effect.asVoid(session.writeFile(path, data, mode))),
      list: (path) => run(session.listFiles(path)),
      copyOut: (guestPath, hostPath) => run(Effect.asVoid(session.copyOut(guestPath, hostPath))),
      copyIn: (hostPath, guestDir) => run(Effect.asVoid(session.copyIn(hostPath, guestDir)))
    }
  }
}

/** a session held in this process: its scope is the handle's, closed by `close()` */
const handleFor = async (
  acquire: Effect.Effect<Programs.Session, unknown, AboxContext | Scope.Scope>
): Promise<SessionHandle> => {
  const scope = await run(Scope.make())
  let session: Programs.Session
  try {
    session = await run(Scope.extend(acquire, scope))
  } catch (error) {
    await run(Scope.close(scope, Exit.void))
    throw error
  }
  let closing: Promise<void> | undefined
  return handleOf(
    session,
    { ...Repo.localRepo(session.connection), turn: session.turn },
    {
      close: () => (closing ??= run(Scope.close(scope, Exit.void))),
      closed: () => closing !== undefined,
      // this process holds the VM: it is frozen here, not through a supervisor
      fork: (options) => run(Fork.fork(session.id, { name: options?.name, freezeRunning: session.freeze }))
    }
  )
}

/** a stopped session's changes as a git patch: the session boots for it and closes again */
export const diff = (ref: string, options: Repo.DiffOptions = {}): Promise<string> =>
  run(Repo.withConnection(ref, (connection) => Repo.diff(connection, options)))

/**
 * A stopped session's changes applied to a host directory (default: the session's recorded
 * source); refuses with SourceChanged (and the paths) where that directory changed since Open.
 */
export const apply = (
  ref: string,
  options: Partial<Repo.ApplyOptions> = {}
): Promise<ReadonlyArray<string>> =>
  run(
    Effect.gen(function* () {
      const to = options.to ?? (yield* Repo.recordedSource(ref))
      return yield* Repo.withConnection(ref, (connection) => Repo.apply(connection, { ...options, to }))
    })
  )

/**
 * What `open` and `SessionManager.start` take beyond the programs' options: the repository's
 * environment (docs/environments.md) is used unless `image` names one (as `--image`). An SDK has
 * no terminal to ask, so the hosts the environment requests are granted only by the policy
 * (`policy`, else `$ABOX_HOME/broker.json`) or `allowEnvHosts` (as `--allow-env-hosts`); the
 * others are left out and told to `onNotice`, with the devcontainer fields ignored and an
 * environment image being built. Callbacks may be plain functions or return an Effect.
 */
export interface EnvironmentHooks {
  /** grant every host the repository's environment asks for (its `allow`) */
  readonly allowEnvHosts?: boolean | undefined
  /** a line for the user: hosts not granted, fields ignored, an environment being built */
  readonly onNotice?: ((line: string) => Effect.Effect<void> | void) | undefined
  /** the environment's setup output as it comes (the first Open of an environment builds it) */
  readonly onSetupOutput?: ((event: TurnEvent) => Effect.Effect<void> | void) | undefined
  /** the environment's install output as it comes (each Open) */
  readonly onInstallOutput?: ((event: TurnEvent) => Effect.Effect<void> | void) | undefined
}

export interface SdkOpenOptions extends Omit<Programs.OpenOptions, "onInstallOutput">, EnvironmentHooks {}

/** a callback that may be plain or return an Effect, as an Effect */
const hook =
  <A>(callback: ((value: A) => Effect.Effect<void> | void) | undefined) =>
  (value: A): Effect.Effect<void> =>
    Effect.suspend(() => {
      const told = callback?.(value)
      return Effect.isEffect(told) ? told : Effect.void
    })

const withEnvironment = (options: SdkOpenOptions) =>
  Environment.openWithEnvironment({
    ...options,
    allowEnvHosts: options.allowEnvHosts,
    // no terminal: consent comes from the options and the policy alone
    consentHosts: undefined,
    onNotice: hook(options.onNotice),
    onSetupOutput: hook(options.onSetupOutput),
    onInstallOutput: hook(options.onInstallOutput)
  })

/**
 * Open: a new session on `options.source` (snapshot → clone golden → boot → transfer), on the
 * repository's environment image when it brings one (built on first use), unless `image` is given.
 */
export const open = (options: SdkOpenOptions): Promise<SessionHandle> => handleFor(withEnvironment(options))

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
export const remove = (ref: string, options: { readonly force?: boolean | undefined } = {}): Promise<void> =>
  // force: a session with forks (they read its frozen layers) is removed after they are made independent
  run(Effect.asVoid(Remove.remove([ref], () => Effect.void, { force: options.force })))

/**
 * Fork a session (`abox fork`): running detached, suspended or stopped; a new session over its
 * frozen disks, with its memory where it had one running or saved. Returns the new session's
 * metadata (resume it by id or name). A session this process holds open: `handle.fork()`.
 */
export const fork = (
  ref: string,
  options: { readonly name?: string | undefined } = {}
): Promise<SessionMeta> => run(Fork.fork(ref, { name: options.name }))
export { ForkRefused, SessionHasForks } from "../programs/fork.js"

// ---- detached sessions: served by a supervisor process (docs/detached.md) ----

export type { StatusInfo as SupervisorStatus } from "../services/ControlRpc.js"
export { SessionNotRunning, ControlError, ControlRefused, ControlVersionMismatch }

/**
 * A handle on a session that a supervisor (another process, `abox start` or
 * `SessionManager.start(…, { detached: true })`) holds: turns go over its control socket;
 * `close()` only disconnects this handle (the session keeps running; `SessionManager.stop` or
 * `abox stop` closes it). Undefined when nobody serves the session.
 */
export const attachTo = async (ref: string): Promise<SessionHandle | undefined> => {
  const status = await run(Detached.statusIfRunning(ref))
  if (Option.isNone(status)) return undefined
  const id = status.value.sessionId
  const { meta, dir } = await run(
    Effect.flatMap(SessionStore, (store) =>
      Effect.flatMap(store.locate(id), ({ dir }) => Effect.map(store.get(id), (meta) => ({ meta, dir })))
    )
  )
  let closed = false
  return handleOf({ id, dir, meta, hello: status.value.hello, skipped: [] }, Detached.remoteSession(id), {
    close: async () => {
      closed = true
    },
    closed: () => closed,
    // its supervisor freezes it (the Fork RPC)
    fork: (options) => run(Fork.fork(id, { name: options?.name }))
  })
}

/** stop a detached session (its supervisor runs Close and exits); false if nobody served it */
export const stopDetached = async (ref: string): Promise<boolean> => {
  const status = await run(Detached.statusIfRunning(ref))
  if (Option.isNone(status)) return false
  await run(Detached.stop(ref))
  return true
}

// ---- seed 001: sessions by name ----

export interface StartOptions extends Omit<SdkOpenOptions, "name"> {
  /** close the session after this many seconds without a turn (default: never) */
  readonly timeout?: number | undefined
  /**
   * run the session under a supervisor process of its own (as `abox start`): it outlives this
   * process, and any process connects to it by name. Takes source, image, model, cpus,
   * memoryMiB, agent, allowEnvHosts and timeout; the broker policy is the default one
   * ($ABOX_HOME/broker.json). The supervisor forwards the environment's `forward` ports to the
   * host's loopback while it runs (docs/environments.md; notices go to its log).
   */
  readonly detached?: boolean | undefined
}

export interface NamedSession extends NameBinding {
  /** open in this manager, or served by a supervisor, right now */
  readonly running: boolean
  /** the supervisor's pid when a supervisor (any process's) serves the session */
  readonly supervisorPid?: number | undefined
}

/**
 * Sessions by human name (seed 001): `start(name, { source, image, timeout })` opens a session
 * bound to the name; `connect(name)` returns the open one or resumes it; `list()`; `stop(name)`
 * closes it (the session stays on disk).
 */
export class SessionManager {
  readonly #open = new Map<string, { readonly handle: SessionHandle; readonly touch: () => void }>()

  async start(name: string, options: StartOptions): Promise<SessionHandle> {
    if (options.detached === true) return this.#startDetached(name, options)
    const { timeout, detached: _detached, ...openOptions } = options
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
    // a session another process started detached: reach it through its supervisor
    const remote = await attachTo(name)
    if (remote !== undefined) return remote
    const { timeout, ...bootOptions } = options
    return await this.#track(name, await resume(name, bootOptions), timeout)
  }

  async #startDetached(name: string, options: StartOptions): Promise<SessionHandle> {
    await run(
      Detached.startDetached({
        open: {
          source: path.resolve(options.source),
          name,
          image: options.image,
          ...(options.allowEnvHosts === true ? { allowEnvHosts: true } : {})
        },
        model: options.model,
        cpus: options.cpus,
        memoryMiB: options.memoryMiB,
        agent: options.agent,
        idleTimeoutMs:
          options.timeout !== undefined ? Math.max(1, Math.round(options.timeout * 1000)) : undefined
      })
    )
    const handle = await attachTo(name)
    if (handle === undefined)
      throw new SessionNotRunning({
        sessionId: name,
        message: `session ${name} stopped as soon as it started`
      })
    return handle
  }

  async list(): Promise<ReadonlyArray<NamedSession>> {
    const names = await run(Effect.flatMap(SessionStore, (store) => store.listNames()))
    const supervisors = await run(
      Effect.forEach(names, (binding) => Detached.statusIfRunning(binding.sessionId), { concurrency: 8 })
    )
    return names.map((binding, i) => {
      const supervisor = Option.getOrUndefined(supervisors[i] ?? Option.none())
      return {
        ...binding,
        running: this.#open.get(binding.name)?.handle.closed === false || supervisor !== undefined,
        ...(supervisor !== undefined ? { supervisorPid: supervisor.pid } : {})
      }
    })
  }

  /** close the named session: the one this manager has open, else a detached one (any process's); false if not running */
  async stop(name: string): Promise<boolean> {
    await run(Effect.flatMap(SessionStore, (store) => store.lookupName(name)))
    const held = this.#open.get(name)
    this.#open.delete(name)
    if (held === undefined || held.handle.closed) return stopDetached(name)
    await held.handle.close()
    return true
  }

  /** fork the named session (the one this manager holds open, or any other): the new session's metadata */
  async fork(name: string, options: { readonly name?: string | undefined } = {}): Promise<SessionMeta> {
    const held = this.#open.get(name)
    if (held !== undefined && !held.handle.closed) return held.handle.fork(options)
    return fork(name, options)
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
      turn: (text, options) => {
        const events = handle.turn(text, options)
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
      run: async (text, options) => {
        await activity((t) => t.begin)
        try {
          return await handle.run(text, options)
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
