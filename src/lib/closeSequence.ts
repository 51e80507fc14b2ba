/**
 * The VMM half of Close, once for every backend (vmm/supervisor.ts for QEMU and vfkit,
 * layers/FakeVmm.ts): the backend's shutdown request → bounded wait → the fallback signal →
 * bounded wait → SIGKILL → bounded wait for the reap. The backend says how to do each step;
 * this says in which order, how long each may take and what the outcome is called.
 *
 * The one rule for the outcome (docs/lifecycle.md, "Close"):
 * - a VM that ended by itself, without a signal from Close, is `graceful` when its status is
 *   clean (exit code 0, no signal) and `crashed` otherwise, whether it ended before Close
 *   began or within the graceful bound after the shutdown request. A guest that powers off
 *   ends its VMM with 0 (QEMU, vfkit, the fake guest's `--on-shutdown exit`); a VMM that exits
 *   with a failure or dies of a signal nobody sent did not shut down, whenever it happened. (The
 *   guest's shutdown RPC runs before this, in the connection's finalizer, so "before Close
 *   began" includes a VM that powered off promptly after it.)
 * - ended after the fallback signal, within its bound: `signalled`, whatever the status;
 * - otherwise `killed`, reaped (the status is known) or not within the last bound.
 * Nothing is sent to a VM that is already gone.
 *
 * Finalizers run uninterruptibly and a timeout cannot cut an uninterruptible wait short, so
 * each wait is made interruptible here: a finalizer that calls this is bounded by the bounds.
 */
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"

/** how a VM process ended (VmExit in services/VmmBackend.ts) */
export interface ProcessExit {
  readonly exitCode: number | null
  readonly signal: string | null
}

/** the three bounds (CloseBounds in services/VmmBackend.ts) */
export interface CloseSequenceBounds {
  /** the shutdown request and the VM's own exit after it */
  readonly graceful: Duration.DurationInput
  /** after the fallback signal */
  readonly signalled: Duration.DurationInput
  /** after SIGKILL, until the reap */
  readonly killed: Duration.DurationInput
}

/** which step ended the VM (CloseOutcome.how in services/SessionStore.ts) */
export type CloseHow = "graceful" | "signalled" | "killed" | "crashed"

export interface CloseSteps {
  readonly bounds: CloseSequenceBounds
  /** the exit, if the VM has already exited and been reaped; never waits */
  readonly poll: Effect.Effect<Option.Option<ProcessExit>>
  /** waits until the VM has exited and been reaped (this sequence bounds the wait) */
  readonly exited: Effect.Effect<ProcessExit>
  /**
   * asks the VM to stop by itself; counted in the graceful bound (Effect.void when the guest's
   * shutdown RPC, which the connection's finalizer sends, is all the asking there is)
   */
  readonly shutdown: Effect.Effect<void>
  /** sends the fallback signal (SIGTERM on Linux, SIGINT to the macOS helper) */
  readonly signal: Effect.Effect<void>
  /** sends SIGKILL (to everything that must go) */
  readonly kill: Effect.Effect<void>
}

export interface CloseResult {
  readonly how: CloseHow
  /** the VM's exit; none when it was not reaped within the last bound */
  readonly exit: Option.Option<ProcessExit>
}

/** the rule for a VM that ended by itself: clean status → graceful, anything else → crashed */
export const endedByItself = (exit: ProcessExit): "graceful" | "crashed" =>
  exit.exitCode === 0 && exit.signal === null ? "graceful" : "crashed"

/** runs `effect`, interruptibly, for at most `bound` */
const within = <A>(bound: Duration.DurationInput, effect: Effect.Effect<A>) =>
  effect.pipe(Effect.interruptible, Effect.timeoutOption(bound))

/** the close sequence (see the module comment); never fails, takes at most the sum of the bounds */
export const closeSequence = Effect.fn("VmmClose.sequence")(function* (steps: CloseSteps) {
  const early = yield* steps.poll
  if (Option.isSome(early)) {
    const result: CloseResult = { how: endedByItself(early.value), exit: early }
    return result
  }
  const shut = yield* within(steps.bounds.graceful, Effect.zipRight(steps.shutdown, steps.exited))
  if (Option.isSome(shut)) {
    const result: CloseResult = { how: endedByItself(shut.value), exit: shut }
    return result
  }
  yield* steps.signal
  const signalled = yield* within(steps.bounds.signalled, steps.exited)
  if (Option.isSome(signalled)) {
    const result: CloseResult = { how: "signalled", exit: signalled }
    return result
  }
  yield* steps.kill
  const killed = yield* within(steps.bounds.killed, steps.exited)
  const result: CloseResult = { how: "killed", exit: killed }
  return result
})
