/**
 * The host's Effect view of one protocol v4 connection: a small adapter over `protocol/Mux.ts`
 * (the plain core the guest runs too), so that the rest of the host side never touches a Promise
 * callback or a listener.
 *
 *   const link = yield* MuxAdapter.make(socket, { maxControlQueue, maxChannels })  // Scope: destroys the mux
 *   link.control        Stream of the guest's control messages in order (one consumer). It ends
 *                       when the connection closes and fails with ProtocolError on a violation.
 *                       Back pressure: while `maxControlQueue` messages wait for the consumer,
 *                       further ones are held by the Mux and then the socket is paused.
 *   link.takeControl    the same messages without a Stream: what has come (a Mailbox takeAll)
 *   link.send(message)  one control message out (Schema-encoded by the Mux)
 *   link.channel(id)    a data channel for the lifetime of the current Scope:
 *     ch.read           Stream of the peer's bytes; credit goes back to the peer as they are
 *                       pulled (a slow reader stops the peer). Interrupting a pull resets the
 *                       channel (bytes in flight would be lost otherwise).
 *     ch.write(bytes)   waits for credit and for the socket (back pressure); ch.end sends EOF;
 *     ch.sink           writes every chunk, then EOF when the input ends.
 *   link.unsafeChannel(id)  the same without a Scope (a turn's output channel): its owner resets it
 *   Closing the channel's Scope resets it locally: pending reads and writes fail, late DATA for
 *   it is dropped. Messages that close a channel on the wire (tunnel_close) are the caller's.
 *
 * A server of guest-opened channels (a broker tunnel) reads `tunnel_open` off `control` (through
 * the dispatcher, which hands out TunnelRequests), answers with `send`, and for an accepted one
 * runs `ch.read` into its upstream and its upstream into `ch.sink`, inside one Scope per tunnel.
 */
import type * as Chunk from "effect/Chunk"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Mailbox from "effect/Mailbox"
import * as Option from "effect/Option"
import * as Runtime from "effect/Runtime"
import type * as Scope from "effect/Scope"
import * as Sink from "effect/Sink"
import * as Stream from "effect/Stream"
import type { Duplex } from "node:stream"
import type { ControlMessage } from "../../protocol/Messages.js"
import { Mux, MuxError, type MuxChannel, type MuxOptions } from "../../protocol/Mux.js"
import { GuestDisconnected, ProtocolError } from "../../services/GuestRpc.js"

/** what a mux operation fails with: the guest broke the protocol, or the connection is gone */
export type LinkError = ProtocolError | GuestDisconnected

/** for byte streams whose users only tell a lost connection (a violation closes it too) */
export const disconnected = (e: LinkError): GuestDisconnected =>
  e._tag === "GuestDisconnected" ? e : new GuestDisconnected({ message: e.message })

export interface HostChannel {
  readonly id: number
  readonly read: Stream.Stream<Uint8Array, LinkError>
  readonly write: (chunk: Uint8Array) => Effect.Effect<void, LinkError>
  /** EOF: no more bytes from this side */
  readonly end: Effect.Effect<void, LinkError>
  /** every chunk written (with back pressure), then EOF */
  readonly sink: Sink.Sink<void, Uint8Array, never, LinkError>
  /** a local reset now (the Scope does it at its close otherwise) */
  readonly reset: (reason: string) => Effect.Effect<void>
  /**
   * the next chunk of the peer's bytes as a Promise (rejected with a LinkError), for a reader
   * that waits on it and on something else at once without abandoning a read (a hot path's
   * hand-made merge); use it or `read`, never both
   */
  readonly next: () => Promise<IteratorResult<Uint8Array>>
}

export interface HostMux {
  readonly control: Stream.Stream<ControlMessage, ProtocolError>
  /**
   * `control` without a Stream (the dispatcher's hot loop): what has come, at least one message
   * unless `done` (the connection closed; a violation fails it). The same queue: use one of them.
   */
  readonly takeControl: Effect.Effect<readonly [Chunk.Chunk<ControlMessage>, boolean], ProtocolError>
  readonly send: (message: ControlMessage) => Effect.Effect<void, LinkError>
  readonly channel: (id: number) => Effect.Effect<HostChannel, never, Scope.Scope>
  /** a data channel without a Scope (a hot path's): its owner resets it when done with it */
  readonly unsafeChannel: (id: number) => HostChannel
  /** completes when the connection has closed (either side, or a violation) */
  readonly closed: Effect.Effect<void>
  /** closed, or closed by a protocol violation */
  readonly isOpen: () => boolean
  /** graceful: what is queued is flushed, then the socket ends */
  readonly close: Effect.Effect<void>
  /** immediate: unsent bytes are dropped (the Scope does it at its close otherwise) */
  readonly destroy: Effect.Effect<void>
  /** a failed mux operation as the host reports it */
  readonly failure: (cause: unknown) => LinkError
}

export interface MuxAdapterOptions extends MuxOptions {
  /** control messages held for `control`'s consumer before the Mux holds more (then pauses) */
  readonly maxControlQueue: number
}

/** a failed mux operation: a protocol violation if the mux recorded one, else a disconnect */
const failureOf = (mux: Mux, cause: unknown): LinkError => {
  const failure = mux.failure
  if (failure !== undefined) return new ProtocolError({ reason: failure.reason, message: failure.message })
  if (cause instanceof MuxError && cause.reason !== "mux closed" && cause.reason !== "connection closed") {
    return new GuestDisconnected({ message: `guest connection: ${cause.reason}` })
  }
  return new GuestDisconnected({ message: "the guest connection closed" })
}

const wrapChannel = (mux: Mux, channel: MuxChannel): HostChannel => {
  const failure = (cause: unknown) => failureOf(mux, cause)
  const write = (chunk: Uint8Array): Effect.Effect<void, LinkError> =>
    Effect.suspend(() =>
      // the sync path writes while credit and the socket allow; otherwise wait for them
      channel.tryWrite(chunk)
        ? Effect.void
        : Effect.tryPromise({ try: () => channel.write(chunk), catch: failure })
    )
  const end = Effect.tryPromise({ try: () => channel.end(), catch: failure })
  const read = Stream.suspend(() => {
    const iterator = channel.readable[Symbol.asyncIterator]()
    return Stream.repeatEffectOption(
      Effect.async<Uint8Array, Option.Option<LinkError>>((resume) => {
        iterator.next().then(
          (result) =>
            resume(result.done === true ? Effect.fail(Option.none()) : Effect.succeed(result.value)),
          (cause) => resume(Effect.fail(Option.some(failure(cause))))
        )
        // an abandoned read would swallow the next chunk: the channel is reset instead
        return Effect.sync(() => channel.destroy(`channel ${channel.id}: read interrupted`))
      })
    )
  })
  let iterator: AsyncIterator<Uint8Array> | undefined
  const next = (): Promise<IteratorResult<Uint8Array>> => {
    iterator ??= channel.readable[Symbol.asyncIterator]()
    return iterator.next().catch((cause: unknown) => Promise.reject(failure(cause)))
  }
  return {
    id: channel.id,
    next,
    read,
    write,
    end,
    sink: Sink.forEachChunk((chunk: Iterable<Uint8Array>) =>
      Effect.forEach(chunk, write, { discard: true })
    ).pipe(Sink.mapEffect(() => end)),
    reset: (reason) => Effect.sync(() => channel.destroy(reason))
  }
}

export const make = (
  socket: Duplex,
  options: MuxAdapterOptions
): Effect.Effect<HostMux, never, Scope.Scope> =>
  Effect.gen(function* () {
    const mux = yield* Effect.acquireRelease(
      Effect.sync(() => new Mux(socket, options)),
      (m) => Effect.sync(() => m.destroy())
    )
    const runtime = yield* Effect.runtime<never>()
    const inbox = yield* Effect.acquireRelease(
      Mailbox.make<ControlMessage, ProtocolError>(options.maxControlQueue),
      (m) => m.shutdown
    )
    const closed = yield* Deferred.make<void>()
    // a full inbox: the Mux counts the pending offer as a message in flight (and pauses the socket)
    mux.onControl((message) =>
      inbox.unsafeOffer(message) ? undefined : Runtime.runPromise(runtime, inbox.offer(message))
    )
    mux.onError((error) =>
      inbox.unsafeDone(Exit.fail(new ProtocolError({ reason: error.reason, message: error.message })))
    )
    mux.onClose(() => {
      inbox.unsafeDone(Exit.void)
      Deferred.unsafeDone(closed, Exit.void)
    })
    // a listener hands the socket over paused: reading starts once the handlers are in place
    socket.resume()
    const failure = (cause: unknown) => failureOf(mux, cause)
    return {
      control: Mailbox.toStream(inbox),
      takeControl: inbox.takeAll,
      send: (message) => Effect.tryPromise({ try: () => mux.sendControl(message), catch: failure }),
      channel: (id) =>
        Effect.acquireRelease(
          Effect.sync(() => mux.channel(id)),
          (channel) => Effect.sync(() => channel.destroy(`channel ${id} closed`))
        ).pipe(Effect.map((channel) => wrapChannel(mux, channel))),
      unsafeChannel: (id) => wrapChannel(mux, mux.channel(id)),
      closed: Deferred.await(closed),
      isOpen: () => !mux.isClosed && mux.failure === undefined,
      close: Effect.sync(() => mux.close()),
      destroy: Effect.sync(() => mux.destroy()),
      failure
    } satisfies HostMux
  })
