/**
 * Turns: `user_turn` / `tty_turn` out, the guest's `agent_event`s and `turn_end` back (routed by
 * the dispatcher into the turn's mailbox). Interrupting a turn's stream cancels the turn, and the
 * next turn waits (bounded) for the guest to end it: the guest runs one turn at a time.
 */
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Chunk from "effect/Chunk"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import { FEATURE_OUTPUT, FEATURE_TTY, type HelloMessage } from "../../protocol/Messages.js"
import {
  type GuestRpcError,
  type TtyRequest,
  TtyUnsupported,
  type TurnEvent
} from "../../services/GuestRpc.js"
import type { Dispatcher, TurnRoute } from "./dispatcher.js"
import type { HostMux } from "./MuxAdapter.js"
import { checkOpen } from "./tunnels.js"
import { outputEvents, withOutputChannel } from "./turnOutput.js"

/** after a cancel, how long the host waits for the guest to end the turn before going on */
const CANCEL_WAIT = Duration.seconds(10)

export const makeTurns = (
  link: HostMux,
  dispatcher: Dispatcher,
  hello: HelloMessage,
  nextChannel: () => number
) => {
  let nextTurn = (hello.contextTurns ?? 0) + 1

  /** interrupted before its end: the guest stops the turn, and the next turn waits (bounded) for it */
  const release = (id: number, route: TurnRoute): Effect.Effect<void> =>
    Effect.suspend(() => {
      route.abandoned = true
      const cancel =
        !route.ended && link.isOpen()
          ? Effect.zipRight(
              link.send({ type: "cancel", turn: id }).pipe(Effect.ignore),
              Deferred.await(route.done).pipe(
                Effect.interruptible,
                Effect.timeout(CANCEL_WAIT),
                Effect.ignore
              )
            )
          : Effect.void
      return Effect.zipRight(
        cancel,
        Effect.suspend(() => {
          dispatcher.turns.delete(id)
          return route.events.shutdown
        })
      )
    })

  /**
   * One turn as a Stream without a Scope of its own (the per-turn path is hot): the first pull
   * registers the turn and sends it, later pulls take what the dispatcher delivered.
   */
  const runTurn = (
    start: (id: number) => Effect.Effect<void, GuestRpcError>
  ): Stream.Stream<TurnEvent, GuestRpcError> =>
    Stream.suspend(() => {
      let id = 0
      let route: TurnRoute | undefined
      let finished = false
      const take = (events: TurnRoute["events"]) =>
        Effect.matchEffect(events.takeAll, {
          onFailure: (error) => Effect.fail(Option.some(error)),
          onSuccess: ([chunk, done]): Effect.Effect<Chunk.Chunk<TurnEvent>, Option.Option<never>> => {
            if (!done) return Effect.succeed(chunk)
            finished = true
            return Chunk.isEmpty(chunk) ? Effect.fail(Option.none()) : Effect.succeed(chunk)
          }
        })
      const begin = Effect.gen(function* () {
        yield* checkOpen(dispatcher)
        id = nextTurn++
        const opened = yield* dispatcher.openTurn(id)
        route = opened
        yield* start(id)
        return opened.events
      })
      const pull = Effect.suspend(() => {
        if (finished) return Effect.fail(Option.none())
        if (route !== undefined) return take(route.events)
        return Effect.flatMap(Effect.mapError(begin, Option.some), take)
      })
      return Stream.repeatEffectChunkOption(pull).pipe(
        Stream.ensuring(Effect.suspend(() => (route === undefined ? Effect.void : release(id, route))))
      )
    })

  const sendTurn = (text: string, mode: "shell" | "prompt" | undefined, output?: number) =>
    Effect.fn("GuestRpc.turn")(function* (id: number) {
      yield* link.send({
        type: "user_turn",
        turn: id,
        text,
        ...(mode === "prompt" ? { mode } : {}),
        ...(output === undefined ? {} : { output })
      })
    })

  const turn = (text: string, mode?: "shell" | "prompt"): Stream.Stream<TurnEvent, GuestRpcError> =>
    // a shell turn's stdout/stderr on a channel of its own, under its credit (FEATURE_OUTPUT):
    // the channel is opened before user_turn names it, and reset when the turn's stream ends
    mode !== "prompt" && hello.features?.includes(FEATURE_OUTPUT) === true
      ? Stream.unwrapScoped(
          Effect.map(link.channel(nextChannel()), (output) =>
            withOutputChannel(outputEvents(output.read), runTurn(sendTurn(text, mode, output.id)))
          )
        )
      : runTurn(sendTurn(text, mode))

  const ttyTurn = (
    text: string,
    request: TtyRequest
  ): Stream.Stream<TurnEvent, TtyUnsupported | GuestRpcError> =>
    // a message type an older v4 guest would not decode: only when the guest lists it
    hello.features?.includes(FEATURE_TTY) !== true
      ? Stream.fail(
          new TtyUnsupported({
            message:
              "this session's guest has no terminal turns (its image predates them): run image-update and open a new session"
          })
        )
      : Stream.unwrapScoped(
          Effect.map(Effect.scope, (scope) =>
            runTurn(
              Effect.fn("GuestRpc.ttyTurn")(function* (id: number) {
                yield* link.send({
                  type: "tty_turn",
                  turn: id,
                  text,
                  rows: request.rows,
                  cols: request.cols,
                  ...(request.term === undefined ? {} : { term: request.term })
                })
                // the client's keys, sizes and signals follow tty_turn; they stop with the turn
                yield* request.controls.pipe(
                  Stream.runForEach((control) =>
                    link.send(
                      control._tag === "Input"
                        ? {
                            type: "turn_input",
                            turn: id,
                            data: Buffer.from(control.bytes).toString("base64")
                          }
                        : control._tag === "Resize"
                          ? { type: "turn_resize", turn: id, rows: control.rows, cols: control.cols }
                          : { type: "turn_signal", turn: id, signal: control.signal }
                    )
                  ),
                  Effect.ignore,
                  Effect.forkIn(scope)
                )
              })
            )
          )
        )

  const cancel = Effect.fn("GuestRpc.cancel")(function* (id: number) {
    yield* link.send({ type: "cancel", turn: id })
  })

  return { turn, ttyTurn, cancel }
}
