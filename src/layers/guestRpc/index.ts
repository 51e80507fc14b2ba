/**
 * The host side of protocol v4 (docs/protocol.md), one file per concern:
 * - listener.ts: binds rpc.sock and hands out the VMM's connection;
 * - MuxAdapter.ts: the Effect view of the Mux (control Stream, channels with a Scope);
 * - dispatcher.ts: routes the guest's control messages to what waits for them;
 * - connection.ts: handshake and the operations of one connection:
 *   turns.ts, transfers.ts (in and out), shutdown.ts, tunnels.ts (tunnels and port forwards).
 */
import * as Cause from "effect/Cause"
import * as Clock from "effect/Clock"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as ExecutionStrategy from "effect/ExecutionStrategy"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import { GuestRpc, GuestTimeout, type GuestRpcOptions, type ResumeOptions } from "../../services/GuestRpc.js"
import { connect } from "./connection.js"
import { bindListener, nextConnection } from "./listener.js"

export { checkGuestProtocol, MAX_GUEST_CHANNELS } from "./connection.js"
export { DEFAULT_TRANSFER_END_TIMEOUT } from "./transfers.js"

export const GuestRpcLive = Layer.succeed(GuestRpc, {
  listen: Effect.fn("GuestRpc.listen")(function* (socketPath: string, options: GuestRpcOptions) {
    const connections = yield* bindListener(socketPath)
    /**
     * The first connection that says hello, within `helloTimeout` of the accept: one that ends
     * before its hello is dropped and the next taken (under vfkit every guest connect to vsock
     * port 1024 is a new connection here, and the guest retries until one carries its bytes).
     */
    const acceptWith = (resumed: ResumeOptions | undefined) =>
      Effect.gen(function* () {
        const parent = yield* Effect.scope
        const deadline = (yield* Clock.currentTimeMillis) + Duration.toMillis(options.helloTimeout)
        let dropped = 0
        while (true) {
          const left = Duration.millis(Math.max(0, deadline - (yield* Clock.currentTimeMillis)))
          const socket = yield* nextConnection(connections, left).pipe(
            Effect.mapError((timeout) =>
              dropped === 0
                ? timeout
                : new GuestTimeout({
                    waitingFor: "hello",
                    message: `${timeout.message} (${dropped} connection${dropped === 1 ? "" : "s"} ended before a hello)`
                  })
            )
          )
          // each attempt in a scope of its own: a dropped connection is released at once
          const scope = yield* Scope.fork(parent, ExecutionStrategy.sequential)
          const exit = yield* Effect.exit(
            Scope.extend(connect(socket, { ...options, helloTimeout: left }, resumed), scope)
          )
          if (Exit.isSuccess(exit)) return exit.value
          yield* Scope.close(scope, exit)
          const failure = Cause.failureOption(exit.cause)
          if (Option.isSome(failure) && failure.value._tag === "ClosedBeforeHello") {
            dropped += 1
            continue
          }
          return yield* Effect.failCause(exit.cause)
        }
      }).pipe(
        // (never reached: the loop takes the next connection instead; for the error type)
        Effect.catchTag("ClosedBeforeHello", (e) => Effect.fail(e.cause)),
        Effect.withSpan("GuestRpc.accept")
      )
    return { accept: acceptWith(undefined), acceptResumed: (resumed: ResumeOptions) => acceptWith(resumed) }
  })
})
