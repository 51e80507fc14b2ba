/**
 * Shutdown: Close's first step. Asks the guest to sync and power off, then waits (bounded) for it
 * to close the connection; a guest already gone or broken needs no asking.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import { type GuestRpcError, GuestTimeout } from "../../services/GuestRpc.js"
import type { HostMux } from "./MuxAdapter.js"

export const makeShutdown = (
  link: HostMux,
  timeout: Duration.DurationInput
): Effect.Effect<void, GuestRpcError> =>
  Effect.gen(function* () {
    if (!link.isOpen()) return
    yield* link.send({ type: "shutdown" }).pipe(Effect.catchTag("GuestDisconnected", () => Effect.void))
    // interruptible: this runs in a finalizer (uninterruptible), where a timeout could not fire
    yield* link.closed.pipe(
      Effect.interruptible,
      Effect.timeoutFail({
        duration: timeout,
        onTimeout: () =>
          new GuestTimeout({
            waitingFor: "shutdown",
            message: `the guest did not close the connection within ${Duration.format(timeout)} of shutdown`
          })
      })
    )
  }).pipe(Effect.withSpan("GuestRpc.shutdown"))
