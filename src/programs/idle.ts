import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as FiberHandle from "effect/FiberHandle"
import * as Ref from "effect/Ref"
import type * as Scope from "effect/Scope"

/** A session's activity, for its idle timeout: turns begin and end; touch is any other use. */
export interface IdleTracker {
  readonly begin: Effect.Effect<void>
  readonly end: Effect.Effect<void>
  readonly touch: Effect.Effect<void>
}

/**
 * `onIdle` runs once the session has had no turn running and no use for `timeout` (Clock time,
 * so TestClock drives it in tests). Each activity restarts the wait; a running turn holds it
 * off until the turn ends. The wait lives in the caller's scope.
 */
export const idleTimeout = (
  timeout: Duration.DurationInput,
  onIdle: Effect.Effect<void>
): Effect.Effect<IdleTracker, never, Scope.Scope> =>
  Effect.gen(function* () {
    const busy = yield* Ref.make(0)
    const waiting = yield* FiberHandle.make<void, never>()
    const rearm = Effect.gen(function* () {
      if ((yield* Ref.get(busy)) > 0) return yield* FiberHandle.clear(waiting)
      yield* FiberHandle.run(waiting, Effect.zipRight(Effect.sleep(Duration.decode(timeout)), onIdle))
    })
    yield* rearm
    return {
      begin: Effect.zipRight(
        Ref.update(busy, (n) => n + 1),
        rearm
      ),
      end: Effect.zipRight(
        Ref.update(busy, (n) => Math.max(0, n - 1)),
        rearm
      ),
      touch: rearm
    }
  })
