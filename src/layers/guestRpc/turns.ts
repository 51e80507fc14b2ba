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
import {
  FEATURE_LIMITS,
  FEATURE_OUTPUT,
  FEATURE_TTY,
  type HelloMessage,
  type TurnLimits
} from "../../protocol/Messages.js"
import { OutputRecordDecoder } from "../../protocol/TurnOutput.js"
import {
  type GuestRpcError,
  type TtyRequest,
  TtyUnsupported,
  type TurnEvent
} from "../../services/GuestRpc.js"
import type { Dispatcher, TurnRoute } from "./dispatcher.js"
import type { HostChannel, HostMux } from "./MuxAdapter.js"
import { checkOpen } from "./tunnels.js"
import { malformedOutput, recordEvent } from "./turnOutput.js"

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
   * One turn as a Stream without a Scope or a fiber of its own (the per-turn path is hot): the
   * first pull registers the turn and sends it, later pulls take what the dispatcher delivered.
   * With an output channel (FEATURE_OUTPUT) a pull also reads the channel's records, one chunk
   * at a time as the consumer asks (its credit goes back only so), and waits on whichever of the
   * two comes first without abandoning the other's read; the control path's `End` comes only
   * after the channel's EOF (the guest sends that EOF before turn_end, so nothing is lost to a
   * reordering on the host). The channel is reset when the stream ends.
   */
  const runTurn = (
    start: (id: number) => Effect.Effect<void, GuestRpcError>,
    output?: HostChannel
  ): Stream.Stream<TurnEvent, GuestRpcError> =>
    Stream.suspend(() => {
      let id = 0
      let route: TurnRoute | undefined
      /** the control path is over (its End, if any, is held in `end` until the channel's EOF) */
      let controlDone = false
      let end: TurnEvent | undefined
      let channelDone = output === undefined
      const decoder = output === undefined ? undefined : new OutputRecordDecoder()
      /** the channel read in flight, and its outcome once settled */
      let reading: Promise<void> | undefined
      let settled: { readonly ok: IteratorResult<Uint8Array> } | { readonly error: unknown } | undefined

      type Pull = Effect.Effect<Chunk.Chunk<TurnEvent>, Option.Option<GuestRpcError>>
      const takeControl = (events: TurnRoute["events"]): Pull =>
        Effect.matchEffect(events.takeAll, {
          onFailure: (error) => Effect.fail(Option.some(error)),
          onSuccess: ([chunk, done]): Pull => {
            if (done) controlDone = true
            if (!channelDone) {
              // End waits for the channel's EOF
              const last = Chunk.last(chunk)
              if (Option.isSome(last) && last.value._tag === "End") {
                end = last.value
                chunk = Chunk.dropRight(chunk, 1)
              }
            }
            if (!Chunk.isEmpty(chunk)) return Effect.succeed(chunk)
            return next
          }
        })
      const startRead = (channel: HostChannel): void => {
        if (reading !== undefined) return
        reading = channel.next().then(
          (ok) => {
            settled = { ok }
          },
          (error: unknown) => {
            settled = { error }
          }
        )
      }
      const consumeRead = (): Pull => {
        const outcome = settled!
        settled = undefined
        reading = undefined
        if ("error" in outcome) return Effect.fail(Option.some(outcome.error as GuestRpcError))
        try {
          if (outcome.ok.done === true) {
            decoder!.end()
            channelDone = true
            return next
          }
          const events = decoder!.push(outcome.ok.value).map(recordEvent)
          return events.length > 0 ? Effect.succeed(Chunk.unsafeFromArray(events)) : next
        } catch (cause) {
          return Effect.fail(Option.some(malformedOutput(cause)))
        }
      }
      /** the next chunk of events from whichever path has one; fails with None at the end */
      const next: Pull = Effect.suspend((): Pull => {
        const events = route!.events
        if (channelDone) {
          if (end !== undefined) {
            const last = end
            end = undefined
            return Effect.succeed(Chunk.of(last))
          }
          return controlDone ? Effect.fail(Option.none()) : takeControl(events)
        }
        if (settled !== undefined) return consumeRead()
        // control events ready now (or its end): take them without waiting
        const size = events.unsafeSize()
        if (!controlDone && (Option.isNone(size) || size.value > 0)) return takeControl(events)
        startRead(output!)
        const waitControl = !controlDone
        const current = reading!
        return Effect.zipRight(
          Effect.async<void>((resume) => {
            let resumed = false
            const go = () => {
              if (resumed) return
              resumed = true
              resume(Effect.void)
            }
            void current.then(go)
            if (waitControl) route!.wake = go
            return Effect.sync(() => {
              resumed = true
              if (route !== undefined && route.wake === go) route.wake = undefined
            })
          }),
          next
        )
      })
      const begin = Effect.gen(function* () {
        yield* checkOpen(dispatcher)
        id = nextTurn++
        route = yield* dispatcher.openTurn(id)
        yield* start(id)
      })
      const pull: Pull = Effect.suspend(() => {
        if (controlDone && channelDone && end === undefined) return Effect.fail(Option.none())
        if (route !== undefined) return next
        return Effect.zipRight(Effect.mapError(begin, Option.some), next)
      })
      return Stream.repeatEffectChunkOption(pull).pipe(
        Stream.ensuring(
          Effect.suspend(() => {
            const released = route === undefined ? Effect.void : release(id, route)
            return output === undefined
              ? released
              : Effect.ensuring(released, output.reset(`channel ${output.id} closed`))
          })
        )
      )
    })

  const sendTurn = (
    text: string,
    mode: "shell" | "prompt" | undefined,
    output?: number,
    limits?: TurnLimits
  ) =>
    Effect.fn("GuestRpc.turn")(function* (id: number) {
      yield* link.send({
        type: "user_turn",
        turn: id,
        text,
        ...(mode === "prompt" ? { mode } : {}),
        ...(output === undefined ? {} : { output }),
        // a field an older guest would ignore: sent only to one that honours it
        ...(mode === "prompt" && limits !== undefined && hello.features?.includes(FEATURE_LIMITS) === true
          ? { limits }
          : {})
      })
    })

  const turn = (
    text: string,
    mode?: "shell" | "prompt",
    limits?: TurnLimits
  ): Stream.Stream<TurnEvent, GuestRpcError> =>
    // a shell turn's stdout/stderr on a channel of its own, under its credit (FEATURE_OUTPUT):
    // the channel is opened before user_turn names it, and reset when the turn's stream ends
    mode !== "prompt" && hello.features?.includes(FEATURE_OUTPUT) === true
      ? Stream.suspend(() => {
          const output = link.unsafeChannel(nextChannel())
          return runTurn(sendTurn(text, mode, output.id), output)
        })
      : runTurn(sendTurn(text, mode, undefined, limits))

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
