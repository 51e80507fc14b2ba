/**
 * Tunnels (guest → host, the broker's: `tunnel_open` on an odd channel, accepted or denied) and
 * port forwards (host → guest: `forward_open` on an even channel, then `forward_accept` or an
 * error naming the channel). Either way the bytes are a MuxAdapter channel.
 */
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import type { ForwardRefused } from "../../services/GuestRpc.js"
import { type ForwardChannel, type GuestRpcError, type TunnelRequest } from "../../services/GuestRpc.js"
import type { Dispatcher } from "./dispatcher.js"
import { disconnected, type HostChannel, type HostMux } from "./MuxAdapter.js"

/** the service's view of a channel: only disconnects (a violation closes the connection anyway) */
const bytes = (channel: HostChannel) => ({
  read: channel.read.pipe(Stream.mapError(disconnected)),
  write: (chunk: Uint8Array) => channel.write(chunk).pipe(Effect.mapError(disconnected))
})

/** a tunnel the guest opened (the Mux has opened its channel and checked its id) */
export const tunnelRequest = (link: HostMux, channel: number, host: string, port: number): TunnelRequest => ({
  channel,
  host,
  port,
  accept: () =>
    Effect.gen(function* () {
      // the channel lives until `close` (or the connection's end): its own scope
      const scope = yield* Scope.make()
      const ch = yield* Scope.extend(link.channel(channel), scope)
      yield* link.send({ type: "tunnel_accept", channel }).pipe(
        Effect.mapError(disconnected),
        Effect.tapError(() => Scope.close(scope, Exit.void))
      )
      return {
        ...bytes(ch),
        // EOF first (after the bytes written so far), so that the guest reads them all; then
        // tunnel_close drops the channel on both ends
        close: ch.end.pipe(
          Effect.timeout("5 seconds"),
          Effect.ignore,
          Effect.zipRight(link.send({ type: "tunnel_close", channel }).pipe(Effect.ignore)),
          Effect.ensuring(Scope.close(scope, Exit.void))
        )
      }
    }),
  deny: (reason: string) => link.send({ type: "tunnel_deny", channel, reason }).pipe(Effect.ignore)
})

/** fails at once when the connection is over */
export const checkOpen = (dispatcher: Dispatcher): Effect.Effect<void, GuestRpcError> =>
  Effect.flatMap(Deferred.poll(dispatcher.terminated), (done) =>
    Option.isSome(done) ? done.value : Effect.void
  )

/** the deferred's outcome, or the connection's end if that comes first */
export const awaitOrTerminated = <A, E>(
  dispatcher: Dispatcher,
  deferred: Deferred.Deferred<A, E>
): Effect.Effect<A, E | GuestRpcError> =>
  Effect.raceFirst(Deferred.await(deferred), Deferred.await(dispatcher.terminated))

/** a port forward: forward_open on a fresh even channel → forward_accept (or a refusal) → bytes */
export const makeForward = (link: HostMux, dispatcher: Dispatcher, nextChannel: () => number) =>
  Effect.fn("GuestRpc.forward")(function* (port: number) {
    yield* checkOpen(dispatcher)
    const id = nextChannel()
    const accepted = yield* Deferred.make<void, ForwardRefused>()
    dispatcher.forwards.set(id, { port, accepted })
    yield* Effect.addFinalizer(() =>
      Effect.sync(() => dispatcher.forwards.delete(id)).pipe(
        // tunnel_close also drops our end of the channel (the mux notes it going out)
        Effect.zipRight(
          link.isOpen() ? link.send({ type: "tunnel_close", channel: id }).pipe(Effect.ignore) : Effect.void
        )
      )
    )
    yield* link.send({ type: "forward_open", channel: id, port })
    const channel = yield* link.channel(id)
    yield* awaitOrTerminated(dispatcher, accepted)
    return {
      ...bytes(channel),
      end: channel.end.pipe(Effect.mapError(disconnected))
    } satisfies ForwardChannel
  }) as (port: number) => Effect.Effect<ForwardChannel, ForwardRefused | GuestRpcError, Scope.Scope>
