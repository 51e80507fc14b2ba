import * as Chunk from "effect/Chunk"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Queue from "effect/Queue"
import type * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
// Raw node:net / node:fs here: the Mux runs over a Node Duplex (the same code the guest uses),
// which @effect/platform's Socket does not hand out; the socket file needs chmod 0600 and a
// liveness probe before a stale file is unlinked.
import * as fs from "node:fs"
import * as net from "node:net"
import type { AgentEvent, ControlMessage, HelloMessage } from "../protocol/Messages.js"
import { FEATURE_EXPORT, FEATURE_OUTPUT, FEATURE_TTY, MIN_GUEST_PROTOCOL, PROTOCOL_VERSION } from "../protocol/Messages.js"
import { outputEvents, withOutputChannel } from "./GuestTurnOutput.js"
import { escapeControl } from "../lib/text.js"
import type { MuxChannel } from "../protocol/Mux.js"
import { Mux, MuxError } from "../protocol/Mux.js"
import {
  type ExportRequest,
  type ForwardChannel,
  ForwardRefused,
  type GuestConnection,
  GuestDisconnected,
  GuestRpc,
  type GuestRpcError,
  type GuestRpcOptions,
  GuestTimeout,
  GuestTooNew,
  GuestTooOld,
  ProtocolError,
  TransferFailed,
  type TransferOptions,
  TtyUnsupported,
  type TtyRequest,
  type TunnelRequest,
  type TurnEvent
} from "../services/GuestRpc.js"

/** control messages held between the socket and the dispatcher before the socket is paused */
const CONTROL_BUFFER = 64
/** events of one turn held for a slow consumer before the dispatcher (and so the socket) waits */
const TURN_BUFFER = 256
/**
 * tunnel requests nobody has taken yet; while it is full the dispatcher waits, so the control
 * queue fills and the socket is paused (back pressure on a guest that floods tunnel_open)
 */
const PENDING_TUNNELS = 64
/**
 * live channels a guest may hold open (pending, accepted or being transferred); one more is a
 * protocol error. Each buffers at most 256 KiB, so this bounds the host's channel memory.
 */
export const MAX_GUEST_CHANNELS = 512
/** after the host's EOF of a transfer, how long it waits for the guest's transfer_end by default */
export const DEFAULT_TRANSFER_END_TIMEOUT = Duration.minutes(5)

/** the version rule of protocol v4 (docs/protocol.md, "Versioning") */
export const checkGuestProtocol = (hello: HelloMessage): Effect.Effect<void, GuestTooOld | GuestTooNew> => {
  if (hello.protocol < MIN_GUEST_PROTOCOL) {
    return Effect.fail(
      new GuestTooOld({
        protocol: hello.protocol,
        minimum: MIN_GUEST_PROTOCOL,
        message: `the guest speaks protocol ${hello.protocol}, this host needs at least ${MIN_GUEST_PROTOCOL}: run image-update, then open a new session`
      })
    )
  }
  if (hello.protocol > PROTOCOL_VERSION) {
    return Effect.fail(
      new GuestTooNew({
        protocol: hello.protocol,
        maximum: PROTOCOL_VERSION,
        message: `the guest speaks protocol ${hello.protocol}, this host speaks up to ${PROTOCOL_VERSION}: update abox on the host`
      })
    )
  }
  return Effect.void
}

const describe = (cause: unknown): string => (cause instanceof Error ? cause.message : String(cause))

/** a failed mux operation: a protocol violation if the mux recorded one, else a disconnect */
const muxFailure = (mux: Mux, cause: unknown): GuestRpcError => {
  const failure = mux.failure
  if (failure !== undefined) return new ProtocolError({ reason: failure.reason, message: failure.message })
  if (cause instanceof MuxError && cause.reason !== "mux closed" && cause.reason !== "connection closed") {
    return new GuestDisconnected({ message: `guest connection: ${cause.reason}` })
  }
  return new GuestDisconnected({ message: "the guest connection closed" })
}

/** is something accepting connections on this unix socket path? */
const probe = (path: string): Effect.Effect<boolean> =>
  Effect.async<boolean>((resume) => {
    const socket = net.connect(path)
    socket.once("connect", () => {
      socket.destroy()
      resume(Effect.succeed(true))
    })
    socket.once("error", () => {
      socket.destroy()
      resume(Effect.succeed(false))
    })
    return Effect.sync(() => socket.destroy())
  })

const bindListener = Effect.fn("GuestRpc.bind")(function* (socketPath: string) {
  const exists = yield* Effect.sync(() => fs.existsSync(socketPath))
  if (exists) {
    if (yield* probe(socketPath)) {
      return yield* new GuestDisconnected({ message: `${socketPath}: another process is listening on it` })
    }
    yield* Effect.try({
      try: () => fs.unlinkSync(socketPath),
      catch: (cause) =>
        new GuestDisconnected({
          message: `${socketPath}: cannot remove the stale socket: ${describe(cause)}`
        })
    })
  }
  const connections = yield* Effect.acquireRelease(Queue.sliding<net.Socket>(4), (queue) =>
    Effect.flatMap(Queue.takeAll(queue), (sockets) =>
      Effect.sync(() => Chunk.forEach(sockets, (s) => s.destroy()))
    ).pipe(Effect.zipRight(Queue.shutdown(queue)))
  )
  yield* Effect.acquireRelease(
    Effect.async<net.Server, GuestDisconnected>((resume) => {
      const server = net.createServer({ pauseOnConnect: true }, (socket) => {
        if (!Queue.unsafeOffer(connections, socket)) socket.destroy()
      })
      server.once("error", (cause) =>
        resume(
          Effect.fail(new GuestDisconnected({ message: `${socketPath}: cannot listen: ${describe(cause)}` }))
        )
      )
      server.listen(socketPath, () => {
        try {
          // the session directory is 0700 already; the socket itself is 0600 as well
          fs.chmodSync(socketPath, 0o600)
        } catch (cause) {
          server.close()
          resume(Effect.fail(new GuestDisconnected({ message: `${socketPath}: chmod: ${describe(cause)}` })))
          return
        }
        resume(Effect.succeed(server))
      })
    }),
    (server) =>
      Effect.async<void>((resume) => {
        server.close(() => resume(Effect.void))
      }).pipe(
        Effect.zipRight(
          Effect.sync(() => {
            try {
              fs.unlinkSync(socketPath)
            } catch {
              // already gone
            }
          })
        )
      )
  )
  return connections
})

const utf8 = new TextEncoder()

/** a guest's event for the turn's consumers: stdout/stderr with their exact bytes (old guests: UTF-8 of data) */
const turnEvent = (event: AgentEvent): TurnEvent => {
  if (event.kind !== "stdout" && event.kind !== "stderr") return { _tag: "Event", event }
  const bytes = event.base64 !== undefined ? Buffer.from(event.base64, "base64") : utf8.encode(event.data)
  return { _tag: "Event", event, bytes }
}

const isTurnEvent = (item: TurnEvent | GuestRpcError): item is TurnEvent =>
  item._tag === "Event" || item._tag === "End"

interface Turn {
  readonly queue: Queue.Queue<TurnEvent | GuestRpcError>
  ended: boolean
  /** completed when the guest ends the turn (turn_end, an error naming it, or a disconnect) */
  readonly done: Deferred.Deferred<void>
  /** nobody reads the queue any more (the stream was interrupted): events are dropped */
  abandoned: boolean
}

/** after a cancel, how long the host waits for the guest to end the turn before going on */
const CANCEL_WAIT = Duration.seconds(10)

const connect = (
  socket: net.Socket,
  options: GuestRpcOptions
): Effect.Effect<GuestConnection, GuestRpcError, Scope.Scope> =>
  Effect.gen(function* () {
    const mux = yield* Effect.acquireRelease(
      Effect.sync(
        () => new Mux(socket, { maxControlQueue: CONTROL_BUFFER, maxChannels: MAX_GUEST_CHANNELS })
      ),
      (m) => Effect.sync(() => m.destroy())
    )
    socket.resume()
    const closed = yield* Deferred.make<void>()
    mux.onClose(() => Deferred.unsafeDone(closed, Exit.void))
    const hello = yield* Deferred.make<HelloMessage, GuestRpcError>()
    const ready = yield* Deferred.make<void, GuestRpcError>()
    const terminated = yield* Deferred.make<never, GuestRpcError>()
    const transfers = new Map<number, Deferred.Deferred<{ files: number; bytes: number }, TransferFailed>>()
    const turns = new Map<number, Turn>()
    const forwards = new Map<
      number,
      { readonly port: number; readonly accepted: Deferred.Deferred<void, ForwardRefused> }
    >()
    const tunnelQueue = yield* Effect.acquireRelease(Queue.bounded<TunnelRequest>(PENDING_TUNNELS), (q) =>
      Queue.shutdown(q)
    )
    let phase: "hello" | "ready" | "run" = "hello"

    const send = (message: ControlMessage): Effect.Effect<void, GuestRpcError> =>
      Effect.tryPromise({ try: () => mux.sendControl(message), catch: (cause) => muxFailure(mux, cause) })

    const control = Stream.async<ControlMessage, GuestRpcError>((emit) => {
      mux.onControl((message) => emit.single(message))
      mux.onError(
        (error) => void emit.fail(new ProtocolError({ reason: error.reason, message: error.message }))
      )
      mux.onClose(() => void emit.end())
    }, CONTROL_BUFFER)

    const channelStream = (channel: MuxChannel): Stream.Stream<Uint8Array, GuestDisconnected> =>
      Stream.fromAsyncIterable(channel.readable, (cause) => muxFailure(mux, cause)).pipe(
        Stream.mapError((e) =>
          e._tag === "GuestDisconnected" ? e : new GuestDisconnected({ message: e.message })
        )
      )

    const tunnelRequest = (channel: number, host: string, port: number): TunnelRequest => ({
      channel,
      host,
      port,
      accept: () =>
        Effect.gen(function* () {
          const ch = mux.channel(channel)
          yield* send({ type: "tunnel_accept", channel }).pipe(
            Effect.mapError((e) =>
              e._tag === "GuestDisconnected" ? e : new GuestDisconnected({ message: e.message })
            )
          )
          return {
            read: channelStream(ch),
            write: (chunk: Uint8Array) =>
              Effect.tryPromise({
                try: () => ch.write(chunk),
                catch: (cause) => new GuestDisconnected({ message: `tunnel ${channel}: ${describe(cause)}` })
              }),
            close: send({ type: "tunnel_close", channel }).pipe(Effect.ignore)
          }
        }),
      deny: (reason: string) => send({ type: "tunnel_deny", channel, reason }).pipe(Effect.ignore)
    })

    const dispatch = (message: ControlMessage): Effect.Effect<void> => {
      if (phase === "hello") {
        if (message.type === "hello") {
          phase = "ready"
          return Deferred.succeed(hello, message)
        }
        return Deferred.fail(
          hello,
          new ProtocolError({
            reason: `expected hello, got ${message.type}`,
            message: `the guest sent ${message.type} before hello`
          })
        )
      }
      if (phase === "ready") {
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
      switch (message.type) {
        case "agent_event": {
          const turn = turns.get(message.turn)
          return turn === undefined || turn.abandoned
            ? Effect.void
            : Queue.offer(turn.queue, turnEvent(message.event))
        }
        case "turn_end": {
          const turn = turns.get(message.turn)
          if (turn === undefined) return Effect.void
          turn.ended = true
          if (turn.abandoned) return Deferred.succeed(turn.done, undefined)
          return Effect.zipRight(
            Deferred.succeed(turn.done, undefined),
            Queue.offer(turn.queue, {
              _tag: "End",
              exitCode: message.exitCode,
              signal: message.signal,
              cancelled: message.cancelled
            })
          )
        }
        case "transfer_end": {
          const pending = transfers.get(message.channel)
          return pending === undefined
            ? Effect.void
            : Deferred.succeed(pending, { files: message.files, bytes: message.bytes })
        }
        case "tunnel_open":
          // waits while PENDING_TUNNELS are untaken: back pressure, never a dropped request
          return Queue.offer(tunnelQueue, tunnelRequest(message.channel, message.host, message.port))
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
          if (message.channel !== undefined && transfers.has(message.channel)) {
            return Deferred.fail(
              transfers.get(message.channel)!,
              new TransferFailed({ reason: escapeControl(message.code), message: text })
            )
          }
          if (message.turn !== undefined) {
            const turn = turns.get(message.turn)
            if (turn !== undefined) {
              turn.ended = true
              if (turn.abandoned) return Deferred.succeed(turn.done, undefined)
              return Effect.zipRight(
                Deferred.succeed(turn.done, undefined),
                Queue.offer(
                  turn.queue,
                  new ProtocolError({ reason: escapeControl(message.code), message: `guest: ${text}` })
                )
              )
            }
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
        yield* Queue.shutdown(tunnelQueue)
        // last: these wait for the turns' consumers (bounded queues); the scope ends them otherwise
        for (const turn of turns.values()) {
          yield* Deferred.succeed(turn.done, undefined)
          if (!turn.ended && !turn.abandoned) yield* Queue.offer(turn.queue, error)
        }
      })

    yield* Stream.runForEach(control, dispatch).pipe(
      Effect.matchEffect({
        onFailure: (error) => terminate(error),
        onSuccess: () => terminate(new GuestDisconnected({ message: "the guest connection closed" }))
      }),
      Effect.forkScoped
    )

    const shutdown: Effect.Effect<void, GuestRpcError> = Effect.gen(function* () {
      if (mux.isClosed || mux.failure !== undefined) return
      yield* send({ type: "shutdown" }).pipe(Effect.catchTag("GuestDisconnected", () => Effect.void))
      // interruptible: this runs in a finalizer (uninterruptible), where a timeout could not fire
      yield* Deferred.await(closed).pipe(
        Effect.interruptible,
        Effect.timeoutFail({
          duration: options.shutdownTimeout,
          onTimeout: () =>
            new GuestTimeout({
              waitingFor: "shutdown",
              message: `the guest did not close the connection within ${Duration.format(options.shutdownTimeout)} of shutdown`
            })
        })
      )
    }).pipe(Effect.withSpan("GuestRpc.shutdown"))
    // Close's first step: runs before the mux is destroyed (finalizers run in reverse)
    yield* Effect.addFinalizer(() =>
      shutdown.pipe(
        Effect.catchAll((error) => Effect.logWarning("guest shutdown", error.message)),
        Effect.ensuring(Effect.sync(() => mux.destroy()))
      )
    )

    // ---- handshake (a failure closes the connection at once) ----
    const handshake = Effect.gen(function* () {
      const helloMessage = yield* Deferred.await(hello).pipe(
        Effect.timeoutFail({
          duration: options.helloTimeout,
          onTimeout: () =>
            new GuestTimeout({
              waitingFor: "hello",
              message: `the guest connected but sent no hello within ${Duration.format(options.helloTimeout)}`
            })
        })
      )
      yield* checkGuestProtocol(helloMessage).pipe(
        Effect.tapError((error) =>
          send({ type: "error", code: "protocol_unsupported", message: error.message }).pipe(Effect.ignore)
        )
      )
      yield* Deferred.await(ready).pipe(
        Effect.timeoutFail({
          duration: options.helloTimeout,
          onTimeout: () =>
            new GuestTimeout({
              waitingFor: "ready",
              message: `the guest sent hello but not ready within ${Duration.format(options.helloTimeout)}`
            })
        })
      )
      return helloMessage
    })
    const helloMessage = yield* handshake.pipe(Effect.tapError(() => Effect.sync(() => mux.close())))

    const transferEndTimeout = Duration.decode(options.transferEndTimeout ?? DEFAULT_TRANSFER_END_TIMEOUT)
    let nextTurn = (helloMessage.contextTurns ?? 0) + 1
    let nextChannel = 2

    const awaitOrTerminated = <A, E>(
      deferred: Deferred.Deferred<A, E>
    ): Effect.Effect<A, E | GuestRpcError> =>
      Effect.raceFirst(Deferred.await(deferred), Deferred.await(terminated))

    const transfer = (
      tar: Stream.Stream<Uint8Array, TransferFailed>,
      target: string,
      transferOptions: TransferOptions = {}
    ): Effect.Effect<{ readonly files: number; readonly bytes: number }, TransferFailed | GuestRpcError> =>
      Effect.gen(function* () {
        const id = nextChannel
        nextChannel += 2
        const result = yield* Deferred.make<{ files: number; bytes: number }, TransferFailed>()
        transfers.set(id, result)
        yield* Effect.addFinalizer(() => Effect.sync(() => transfers.delete(id)))
        yield* send({
          type: "transfer_begin",
          channel: id,
          format: "tar",
          target,
          ...(transferOptions.baseline === true ? { baseline: true } : {})
        })
        const channel = mux.channel(id)
        yield* Effect.addFinalizer(() => Effect.sync(() => channel.destroy("transfer finished")))
        // the sync path writes while credit and the socket allow; otherwise wait for them
        const pipe = Stream.runForEach(tar, (chunk) =>
          Effect.suspend(() =>
            channel.tryWrite(chunk)
              ? Effect.void
              : Effect.tryPromise({
                  try: () => channel.write(chunk),
                  catch: (cause) => muxFailure(mux, cause)
                })
          )
        ).pipe(
          Effect.zipRight(
            Effect.tryPromise({ try: () => channel.end(), catch: (cause) => muxFailure(mux, cause) })
          ),
          Effect.zipRight(
            awaitOrTerminated(result).pipe(
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
            Effect.flatMap(Deferred.poll(terminated), (done) =>
              Option.isSome(done) ? done.value : Effect.fail(error)
            )
          )
        )
      }).pipe(Effect.scoped, Effect.withSpan("GuestRpc.transfer"))

    /** guest → host: the channel is opened here before `export_begin` names it */
    const exportTree = (request: ExportRequest): Stream.Stream<Uint8Array, TransferFailed | GuestRpcError> =>
      Stream.unwrapScoped(
        Effect.gen(function* () {
          yield* Effect.flatMap(Deferred.poll(terminated), (done) =>
            Option.isSome(done) ? done.value : Effect.void
          )
          // a message type an older v4 guest would not decode: only when the guest lists it
          if (helloMessage.features?.includes(FEATURE_EXPORT) !== true) {
            return yield* new TransferFailed({
              reason: "unsupported",
              message:
                "this session's guest cannot send files back (its image predates it): run image-update and open a new session"
            })
          }
          const id = nextChannel
          nextChannel += 2
          const result = yield* Deferred.make<{ files: number; bytes: number }, TransferFailed>()
          transfers.set(id, result)
          yield* Effect.addFinalizer(() => Effect.sync(() => transfers.delete(id)))
          const channel = mux.channel(id)
          yield* Effect.addFinalizer(() => Effect.sync(() => channel.destroy("export finished")))
          yield* send({
            type: "export_begin",
            channel: id,
            tree: request.tree,
            paths: [...request.paths],
            exclude: [...(request.exclude ?? [])],
            ...(request.changed === true ? { changed: true } : {})
          })
          // a refusal or a disconnect: the channel is destroyed first, which ends a pending read
          // (an async iterator's return() would wait for it)
          const failed = awaitOrTerminated(result).pipe(
            Effect.tapError(() => Effect.sync(() => channel.destroy("export failed"))),
            Effect.zipRight(Effect.never)
          )
          return channelStream(channel).pipe(
            Stream.interruptWhen(failed),
            // the bytes end with the guest's EOF; the export is complete only with its transfer_end
            Stream.concat(Stream.drain(Stream.fromEffect(awaitOrTerminated(result)))),
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

    const turn = (text: string, mode?: "shell" | "prompt"): Stream.Stream<TurnEvent, GuestRpcError> =>
      // a shell turn's stdout/stderr on a channel of its own, under its credit (FEATURE_OUTPUT)
      mode !== "prompt" && helloMessage.features?.includes(FEATURE_OUTPUT) === true
        ? runTurn((id, output) => send({ type: "user_turn", turn: id, text, output }), true)
        : runTurn((id) => send({ type: "user_turn", turn: id, text, ...(mode === "prompt" ? { mode } : {}) }))

    const ttyTurn = (text: string, request: TtyRequest): Stream.Stream<TurnEvent, TtyUnsupported | GuestRpcError> =>
      // a message type an older v4 guest would not decode: only when the guest lists it
      helloMessage.features?.includes(FEATURE_TTY) !== true
        ? Stream.fail(
            new TtyUnsupported({
              message:
                "this session's guest has no terminal turns (its image predates them): run image-update and open a new session"
            })
          )
        : runTurn((id) =>
            Effect.gen(function* () {
              yield* send({
                type: "tty_turn",
                turn: id,
                text,
                rows: request.rows,
                cols: request.cols,
                ...(request.term === undefined ? {} : { term: request.term })
              })
              // the client's keys, sizes and signals follow tty_turn; they stop with the turn's scope
              yield* request.controls.pipe(
                Stream.runForEach((control) =>
                  send(
                    control._tag === "Input"
                      ? { type: "turn_input", turn: id, data: Buffer.from(control.bytes).toString("base64") }
                      : control._tag === "Resize"
                        ? { type: "turn_resize", turn: id, rows: control.rows, cols: control.cols }
                        : { type: "turn_signal", turn: id, signal: control.signal }
                  )
                ),
                Effect.ignore,
                Effect.forkScoped
              )
            })
          )

    const runTurn = (
      start: (id: number, output: number) => Effect.Effect<void, GuestRpcError, Scope.Scope>,
      withOutput = false
    ): Stream.Stream<TurnEvent, GuestRpcError> =>
      Stream.unwrapScoped(
        Effect.gen(function* () {
          yield* Effect.flatMap(Deferred.poll(terminated), (done) =>
            Option.isSome(done) ? done.value : Effect.void
          )
          const id = nextTurn++
          const entry: Turn = {
            queue: yield* Queue.bounded<TurnEvent | GuestRpcError>(TURN_BUFFER),
            ended: false,
            done: yield* Deferred.make<void>(),
            abandoned: false
          }
          turns.set(id, entry)
          yield* Effect.addFinalizer(() =>
            Effect.gen(function* () {
              entry.abandoned = true
              // interrupted before its end: the guest stops the turn, and the next turn waits
              // (bounded) for it to be over — the guest runs one turn at a time
              if (!entry.ended && !mux.isClosed) {
                yield* send({ type: "cancel", turn: id }).pipe(Effect.ignore)
                yield* Deferred.await(entry.done).pipe(
                  Effect.interruptible,
                  Effect.timeout(CANCEL_WAIT),
                  Effect.ignore
                )
              }
              turns.delete(id)
              yield* Queue.shutdown(entry.queue)
            })
          )
          let output: MuxChannel | undefined
          if (withOutput) {
            const outputId = nextChannel
            nextChannel += 2
            output = mux.channel(outputId)
            yield* Effect.addFinalizer(() => Effect.sync(() => output!.destroy("turn finished")))
          }
          yield* start(id, output?.id ?? 0)
          const events = Stream.fromQueue(entry.queue).pipe(
            Stream.mapEffect((item) => (isTurnEvent(item) ? Effect.succeed(item) : Effect.fail(item))),
            Stream.takeUntil((event) => event._tag === "End")
          )
          return output === undefined ? events : withOutputChannel(outputEvents(channelStream(output)), events)
        })
      )

    /** a port forward: forward_open on a fresh even channel → forward_accept (or a refusal) → bytes */
    const forward = (
      port: number
    ): Effect.Effect<ForwardChannel, ForwardRefused | GuestRpcError, Scope.Scope> =>
      Effect.gen(function* () {
        yield* Effect.flatMap(Deferred.poll(terminated), (done) =>
          Option.isSome(done) ? done.value : Effect.void
        )
        const id = nextChannel
        nextChannel += 2
        const accepted = yield* Deferred.make<void, ForwardRefused>()
        forwards.set(id, { port, accepted })
        yield* Effect.addFinalizer(() =>
          Effect.sync(() => forwards.delete(id)).pipe(
            // tunnel_close also drops our end of the channel (the mux notes it going out)
            Effect.zipRight(
              mux.isClosed ? Effect.void : send({ type: "tunnel_close", channel: id }).pipe(Effect.ignore)
            )
          )
        )
        yield* send({ type: "forward_open", channel: id, port })
        const channel = mux.channel(id)
        yield* awaitOrTerminated(accepted)
        const disconnected = (e: GuestRpcError) =>
          e._tag === "GuestDisconnected" ? e : new GuestDisconnected({ message: e.message })
        return {
          read: channelStream(channel),
          write: (chunk: Uint8Array) =>
            Effect.tryPromise({
              try: () => channel.write(chunk),
              catch: (cause) => muxFailure(mux, cause)
            }).pipe(Effect.mapError(disconnected)),
          end: Effect.tryPromise({ try: () => channel.end(), catch: (cause) => muxFailure(mux, cause) }).pipe(
            Effect.mapError(disconnected)
          )
        } satisfies ForwardChannel
      }).pipe(Effect.withSpan("GuestRpc.forward"))

    const cancel = Effect.fn("GuestRpc.cancel")(function* (id: number) {
      yield* send({ type: "cancel", turn: id })
    })

    return {
      hello: helloMessage,
      transfer,
      exportTree,
      turn,
      ttyTurn,
      cancel,
      shutdown,
      tunnels: Stream.fromQueue(tunnelQueue),
      forward
    } satisfies GuestConnection
  })

export const GuestRpcLive = Layer.succeed(GuestRpc, {
  listen: Effect.fn("GuestRpc.listen")(function* (socketPath: string, options: GuestRpcOptions) {
    const connections = yield* bindListener(socketPath)
    const accept = Effect.gen(function* () {
      const socket = yield* Queue.take(connections).pipe(
        Effect.timeoutFail({
          duration: options.helloTimeout,
          onTimeout: () =>
            new GuestTimeout({
              waitingFor: "hello",
              message: `the guest did not connect within ${Duration.format(options.helloTimeout)}`
            })
        })
      )
      return yield* connect(socket, options)
    }).pipe(Effect.withSpan("GuestRpc.accept"))
    return { accept }
  })
})
