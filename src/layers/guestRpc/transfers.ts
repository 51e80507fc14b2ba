/**
 * Transfers: a tar into the guest (`transfer_begin` on a fresh even channel, the bytes, EOF, then
 * the guest's `transfer_end`) and out of it (`export_begin`: the guest's bytes, then
 * `transfer_end`). A refusal (an error naming the channel) or a disconnect ends either at once.
 */
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import { TransferFailed } from "../../domain/transfer.js"
import { FEATURE_EXPORT, type HelloMessage } from "../../protocol/Messages.js"
import {
  type ExportRequest,
  type GuestRpcError,
  GuestTimeout,
  type TransferOptions
} from "../../services/GuestRpc.js"
import type { Dispatcher, TransferResult } from "./dispatcher.js"
import { disconnected, type HostMux } from "./MuxAdapter.js"
import { awaitOrTerminated, checkOpen } from "./tunnels.js"

/** after the host's EOF of a transfer, how long it waits for the guest's transfer_end by default */
export const DEFAULT_TRANSFER_END_TIMEOUT = Duration.minutes(5)

export const makeTransfers = (
  link: HostMux,
  dispatcher: Dispatcher,
  hello: HelloMessage,
  nextChannel: () => number,
  transferEndTimeoutInput: Duration.DurationInput | undefined
) => {
  const transferEndTimeout = Duration.decode(transferEndTimeoutInput ?? DEFAULT_TRANSFER_END_TIMEOUT)

  /** a fresh channel id whose transfer_end (or refusal) the dispatcher routes here, for the scope */
  const register = Effect.gen(function* () {
    const id = nextChannel()
    const result = yield* Deferred.make<TransferResult, TransferFailed>()
    dispatcher.transfers.set(id, result)
    yield* Effect.addFinalizer(() => Effect.sync(() => dispatcher.transfers.delete(id)))
    return { id, result }
  })

  const transfer = Effect.fn("GuestRpc.transfer")(function* (
    tar: Stream.Stream<Uint8Array, TransferFailed>,
    target: string,
    options: TransferOptions = {}
  ) {
    const { id, result } = yield* register
    yield* link.send({
      type: "transfer_begin",
      channel: id,
      format: "tar",
      target,
      ...(options.baseline === true ? { baseline: true } : {})
    })
    const channel = yield* link.channel(id)
    const pipe = Stream.run(tar, channel.sink).pipe(
      Effect.zipRight(
        awaitOrTerminated(dispatcher, result).pipe(
          Effect.timeoutFail({
            duration: transferEndTimeout,
            onTimeout: () =>
              new GuestTimeout({
                waitingFor: "transfer_end",
                message: `the guest did not confirm the transfer within ${Duration.format(transferEndTimeout)} of its end`
              })
          })
        )
      )
    )
    // the guest may refuse the transfer while we are still sending: stop writing then
    const refused = Effect.zipRight(Deferred.await(result), Effect.never)
    // a disconnect wins over the write error it causes
    return yield* Effect.raceFirst(pipe, refused).pipe(
      Effect.catchAll((error: TransferFailed | GuestRpcError) =>
        Effect.flatMap(Deferred.poll(dispatcher.terminated), (done) =>
          Option.isSome(done) ? done.value : Effect.fail(error)
        )
      )
    )
  }, Effect.scoped)

  /** guest → host: the channel is opened here before `export_begin` names it */
  const exportTree = (request: ExportRequest): Stream.Stream<Uint8Array, TransferFailed | GuestRpcError> =>
    Stream.unwrapScoped(
      Effect.gen(function* () {
        yield* checkOpen(dispatcher)
        // a message type an older v4 guest would not decode: only when the guest lists it
        if (hello.features?.includes(FEATURE_EXPORT) !== true) {
          return yield* new TransferFailed({
            reason: "unsupported",
            message:
              "this session's guest cannot send files back (its image predates it): run image-update and open a new session"
          })
        }
        const { id, result } = yield* register
        const channel = yield* link.channel(id)
        // ended before the guest's transfer_end (a refusal here, the reader gone): the guest is
        // told to stop (tunnel_close drops the channel on both sides; its tar is killed), so
        // that it does not go on sending what nobody reads
        yield* Effect.addFinalizer(() =>
          Effect.flatMap(Deferred.isDone(result), (done) =>
            done ? Effect.void : link.send({ type: "tunnel_close", channel: id }).pipe(Effect.ignore)
          )
        )
        yield* link.send({
          type: "export_begin",
          channel: id,
          tree: request.tree,
          paths: [...request.paths],
          exclude: [...(request.exclude ?? [])],
          ...(request.changed === true ? { changed: true } : {})
        })
        // a refusal or a disconnect: the channel is reset first, which ends a pending read
        const failed = awaitOrTerminated(dispatcher, result).pipe(
          Effect.tapError(() => channel.reset("export failed")),
          Effect.zipRight(Effect.never)
        )
        return channel.read.pipe(
          Stream.mapError(disconnected),
          Stream.interruptWhen(failed),
          // the bytes end with the guest's EOF; the export is complete only with its transfer_end
          Stream.concat(Stream.drain(Stream.fromEffect(awaitOrTerminated(dispatcher, result)))),
          Stream.catchAll((error: TransferFailed | GuestRpcError) =>
            Stream.fromEffect(
              Effect.flatMap(Deferred.poll(result), (done) =>
                Option.isSome(done)
                  ? Effect.flatMap(done.value, () => Effect.fail(error))
                  : Effect.fail(error)
              )
            )
          )
        )
      })
    ).pipe(Stream.withSpan("GuestRpc.exportTree"))

  return { transfer, exportTree }
}
