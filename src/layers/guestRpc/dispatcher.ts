/**
 * The dispatcher: the one consumer of the guest's control messages. It checks the handshake
 * order (hello, then ready) and routes every later message to the operation waiting for it — a
 * turn's events, a transfer's end, a forward's acceptance, a tunnel request. What nobody waits
 * for (an unknown turn or channel, a late or repeated end) is dropped; a guest that floods is
 * held back, never buffered without bound: a full turn or tunnel queue stops the dispatcher,
 * which stops reading `control`, which pauses the socket (MuxAdapter).
 */
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Mailbox from "effect/Mailbox"
import * as Queue from "effect/Queue"
import type * as Scope from "effect/Scope"
import { TransferFailed } from "../../domain/transfer.js"
import { escapeControl } from "../../lib/text.js"
import type { ControlMessage, HelloMessage } from "../../protocol/Messages.js"
import {
  agentTurnEvent,
  ForwardRefused,
  GuestDisconnected,
  type GuestRpcError,
  ProtocolError,
  type TunnelRequest,
  type TurnEvent
} from "../../services/GuestRpc.js"
import type { HostMux } from "./MuxAdapter.js"
import { tunnelRequest } from "./tunnels.js"

/** events of one turn held for a slow consumer before the dispatcher (and so the socket) waits */
const TURN_BUFFER = 256
/**
 * tunnel requests nobody has taken yet; while it is full the dispatcher waits, so the control
 * queue fills and the socket is paused (back pressure on a guest that floods tunnel_open)
 */
const PENDING_TUNNELS = 64

export interface TurnRoute {
  readonly events: Mailbox.Mailbox<TurnEvent, GuestRpcError>
  /** the guest ended the turn (turn_end, an error naming it, or a disconnect) */
  ended: boolean
  /** completed when the turn ends */
  readonly done: Deferred.Deferred<void>
  /** nobody reads the events any more (the stream was interrupted): they are dropped */
  abandoned: boolean
  /** called once after the next delivery or end (a reader waiting on this and on something else) */
  wake?: (() => void) | undefined
}

const wake = (route: TurnRoute): void => {
  const w = route.wake
  if (w !== undefined) {
    route.wake = undefined
    w()
  }
}

export type TransferResult = { readonly files: number; readonly bytes: number }

export interface ForwardRoute {
  readonly port: number
  readonly accepted: Deferred.Deferred<void, ForwardRefused>
}

export interface Dispatcher {
  /** the guest's hello and ready, in this order (fails on anything else first) */
  readonly hello: Deferred.Deferred<HelloMessage, GuestRpcError>
  readonly ready: Deferred.Deferred<void, GuestRpcError>
  /** fails when the connection is over: every later operation fails with the reason */
  readonly terminated: Deferred.Deferred<never, GuestRpcError>
  readonly turns: Map<number, TurnRoute>
  readonly transfers: Map<number, Deferred.Deferred<TransferResult, TransferFailed>>
  readonly forwards: Map<number, ForwardRoute>
  readonly tunnels: Queue.Dequeue<TunnelRequest>
  /** a new turn's route (removed by the caller) */
  readonly openTurn: (id: number) => Effect.Effect<TurnRoute>
}

/** into a turn's events: at once while there is room, else wait (back pressure) */
const deliver = (route: TurnRoute, item: TurnEvent): Effect.Effect<void> => {
  if (route.events.unsafeOffer(item)) {
    wake(route)
    return Effect.void
  }
  return Effect.zipRight(
    route.events.offer(item),
    Effect.sync(() => wake(route))
  )
}

/** the turn is over: its consumer reads what is queued, then the end (or the error) */
const finish = (
  route: TurnRoute,
  last:
    | {
        readonly _tag: "End"
        readonly exitCode: number | null
        readonly signal: string | null
        readonly cancelled: boolean
      }
    | GuestRpcError
): Effect.Effect<void> => {
  route.ended = true
  Deferred.unsafeDone(route.done, Exit.void)
  if (route.abandoned) return Effect.void
  if (last._tag === "End") {
    if (route.events.unsafeOffer(last)) {
      route.events.unsafeDone(Exit.void)
      wake(route)
      return Effect.void
    }
    return Effect.zipRight(
      deliver(route, last),
      Effect.sync(() => {
        route.events.unsafeDone(Exit.void)
        wake(route)
      })
    )
  }
  route.events.unsafeDone(Exit.fail(last))
  wake(route)
  return Effect.void
}

/** starts the dispatcher on `link.takeControl` for the lifetime of the scope */
export const start = (link: HostMux): Effect.Effect<Dispatcher, never, Scope.Scope> =>
  Effect.gen(function* () {
    const hello = yield* Deferred.make<HelloMessage, GuestRpcError>()
    const ready = yield* Deferred.make<void, GuestRpcError>()
    const terminated = yield* Deferred.make<never, GuestRpcError>()
    const turns = new Map<number, TurnRoute>()
    const transfers = new Map<number, Deferred.Deferred<TransferResult, TransferFailed>>()
    const forwards = new Map<number, ForwardRoute>()
    const tunnels = yield* Effect.acquireRelease(Queue.bounded<TunnelRequest>(PENDING_TUNNELS), (q) =>
      Queue.shutdown(q)
    )

    /** the handshake: hello, then ready; anything else first fails it (and so the accept) */
    let phase: "hello" | "ready" | "run" = "hello"
    const handshake = (message: ControlMessage): Effect.Effect<void> => {
      if (phase === "hello") {
        if (message.type !== "hello") {
          return Deferred.fail(
            hello,
            new ProtocolError({
              reason: `expected hello, got ${message.type}`,
              message: `the guest sent ${message.type} before hello`
            })
          )
        }
        phase = "ready"
        return Deferred.succeed(hello, message)
      }
      if (message.type === "ready") {
        phase = "run"
        return Deferred.succeed(ready, undefined)
      }
      const reason =
        message.type === "error"
          ? `guest error ${escapeControl(`${message.code}: ${message.message}`)}`
          : `expected ready, got ${message.type}`
      return Deferred.fail(
        ready,
        new ProtocolError({ reason, message: `the guest did not become ready: ${reason}` })
      )
    }

    const route = (message: ControlMessage): Effect.Effect<void> => {
      switch (message.type) {
        case "agent_event": {
          const turn = turns.get(message.turn)
          return turn === undefined || turn.abandoned || turn.ended
            ? Effect.void
            : deliver(turn, agentTurnEvent(message.event))
        }
        case "turn_end": {
          const turn = turns.get(message.turn)
          if (turn === undefined || turn.ended) return Effect.void
          return finish(turn, {
            _tag: "End",
            exitCode: message.exitCode,
            signal: message.signal,
            cancelled: message.cancelled
          })
        }
        case "transfer_end": {
          const pending = transfers.get(message.channel)
          return pending === undefined
            ? Effect.void
            : Deferred.succeed(pending, { files: message.files, bytes: message.bytes })
        }
        case "tunnel_open":
          // waits while PENDING_TUNNELS are untaken: back pressure, never a dropped request
          return Queue.offer(tunnels, tunnelRequest(link, message.channel, message.host, message.port))
        case "tunnel_close": // the mux has dropped the channel; its reader fails
          return Effect.void
        case "forward_accept": {
          const pending = forwards.get(message.channel)
          return pending === undefined ? Effect.void : Deferred.succeed(pending.accepted, undefined)
        }
        case "error": {
          // the guest's words: never a control character on the way to a terminal
          const text = escapeControl(`${message.code}: ${message.message}`)
          const forward = message.channel !== undefined ? forwards.get(message.channel) : undefined
          if (forward !== undefined) {
            return Deferred.fail(
              forward.accepted,
              new ForwardRefused({ port: forward.port, message: `port ${forward.port}: ${text}` })
            )
          }
          const transfer = message.channel !== undefined ? transfers.get(message.channel) : undefined
          if (transfer !== undefined) {
            return Deferred.fail(
              transfer,
              new TransferFailed({ reason: escapeControl(message.code), message: text })
            )
          }
          const turn = message.turn !== undefined ? turns.get(message.turn) : undefined
          if (turn !== undefined) {
            if (turn.ended) return Effect.void
            return finish(
              turn,
              new ProtocolError({ reason: escapeControl(message.code), message: `guest: ${text}` })
            )
          }
          return Effect.logWarning("guest reported an error").pipe(
            Effect.annotateLogs({ code: escapeControl(message.code), text })
          )
        }
        default:
          return Effect.logWarning("guest sent a host-to-guest message").pipe(
            Effect.annotateLogs({ type: message.type })
          )
      }
    }

    const dispatch = (message: ControlMessage): Effect.Effect<void> =>
      phase === "run" ? route(message) : handshake(message)

    const terminate = (error: GuestRpcError): Effect.Effect<void> =>
      Effect.gen(function* () {
        yield* Deferred.fail(terminated, error)
        yield* Deferred.fail(hello, error)
        yield* Deferred.fail(ready, error)
        for (const pending of forwards.values()) {
          yield* Deferred.fail(
            pending.accepted,
            new ForwardRefused({ port: pending.port, message: error.message })
          )
        }
        for (const pending of transfers.values()) {
          yield* Deferred.fail(pending, new TransferFailed({ reason: error._tag, message: error.message }))
        }
        yield* Queue.shutdown(tunnels)
        for (const turn of turns.values()) if (!turn.ended) yield* finish(turn, error)
      })

    // a plain loop on the adapter's queue (no Stream per message: the per-turn path is hot)
    const loop: Effect.Effect<void, ProtocolError> = Effect.flatMap(link.takeControl, ([chunk, done]) => {
      const routed = Effect.forEach(chunk, dispatch, { discard: true })
      return done ? routed : Effect.zipRight(routed, loop)
    })
    yield* loop.pipe(
      Effect.matchEffect({
        onFailure: (error) => terminate(error),
        onSuccess: () => terminate(new GuestDisconnected({ message: "the guest connection closed" }))
      }),
      Effect.forkScoped
    )

    return {
      hello,
      ready,
      terminated,
      turns,
      transfers,
      forwards,
      tunnels,
      openTurn: (id) =>
        Effect.gen(function* () {
          const turnRoute: TurnRoute = {
            events: yield* Mailbox.make<TurnEvent, GuestRpcError>(TURN_BUFFER),
            ended: false,
            done: yield* Deferred.make<void>(),
            abandoned: false
          }
          turns.set(id, turnRoute)
          return turnRoute
        })
    } satisfies Dispatcher
  })
