/**
 * One guest connection: the adapter over its socket, the dispatcher on its control messages, the
 * handshake (hello, version check, ready), and the operations; the connection's scope ends with
 * Close's first step (shutdown), then the mux is destroyed.
 */
import * as Clock from "effect/Clock"
import * as Data from "effect/Data"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import type * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as crypto from "node:crypto"
import type { Duplex } from "node:stream"
import { type HelloMessage, MIN_GUEST_PROTOCOL, PROTOCOL_VERSION } from "../../protocol/Messages.js"
import {
  type GuestConnection,
  type GuestRpcError,
  type GuestRpcOptions,
  type ResumeOptions,
  GuestTimeout,
  GuestTooNew,
  GuestTooOld
} from "../../services/GuestRpc.js"
import * as Dispatcher from "./dispatcher.js"
import * as MuxAdapter from "./MuxAdapter.js"
import { makeShutdown } from "./shutdown.js"
import { makeTransfers } from "./transfers.js"
import { makeTurns } from "./turns.js"
import { makeForward } from "./tunnels.js"

/** control messages held between the socket and the dispatcher before the socket is paused */
const CONTROL_BUFFER = 64
/**
 * live channels a guest may hold open (pending, accepted or being transferred); one more is a
 * protocol error. Each buffers at most 256 KiB, so this bounds the host's channel memory.
 */
export const MAX_GUEST_CHANNELS = 512

/**
 * The connection ended before the guest's hello: under vfkit each guest connection to vsock port
 * 1024 is a new connection to rpc.sock, and a guest whose connect it retries may leave one that
 * never speaks. The listener takes the next connection (src/layers/guestRpc/index.ts).
 */
export class ClosedBeforeHello extends Data.TaggedError("ClosedBeforeHello")<{
  readonly cause: GuestRpcError
}> {}

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

/** hello within the timeout, a version this host speaks, then ready within the timeout */
const handshake = (
  link: MuxAdapter.HostMux,
  dispatcher: Dispatcher.Dispatcher,
  helloTimeout: Duration.DurationInput
): Effect.Effect<HelloMessage, GuestRpcError | ClosedBeforeHello> =>
  Effect.gen(function* () {
    const hello = yield* Deferred.await(dispatcher.hello).pipe(
      Effect.catchTag("GuestDisconnected", (cause) => Effect.fail(new ClosedBeforeHello({ cause }))),
      Effect.timeoutFail({
        duration: helloTimeout,
        onTimeout: () =>
          new GuestTimeout({
            waitingFor: "hello",
            message: `the guest connected but sent no hello within ${Duration.format(helloTimeout)}`
          })
      })
    )
    yield* checkGuestProtocol(hello).pipe(
      Effect.tapError((error) =>
        link.send({ type: "error", code: "protocol_unsupported", message: error.message }).pipe(Effect.ignore)
      )
    )
    yield* Deferred.await(dispatcher.ready).pipe(
      Effect.timeoutFail({
        duration: helloTimeout,
        onTimeout: () =>
          new GuestTimeout({
            waitingFor: "ready",
            message: `the guest sent hello but not ready within ${Duration.format(helloTimeout)}`
          })
      })
    )
    return hello
  })

export const connect = (
  socket: Duplex,
  options: GuestRpcOptions,
  resumed?: ResumeOptions
): Effect.Effect<GuestConnection, GuestRpcError | ClosedBeforeHello, Scope.Scope> =>
  Effect.gen(function* () {
    const link = yield* MuxAdapter.make(socket, {
      maxControlQueue: CONTROL_BUFFER,
      maxChannels: MAX_GUEST_CHANNELS
    })
    const dispatcher = yield* Dispatcher.start(link)
    const shutdown = makeShutdown(link, options.shutdownTimeout)
    // Close's first step: runs before the dispatcher stops and the mux is destroyed
    yield* Effect.addFinalizer(() =>
      shutdown.pipe(
        Effect.catchAll((error) => Effect.logWarning("guest shutdown", error.message)),
        Effect.ensuring(link.destroy)
      )
    )
    // warm open: the waiting guest's session comes first (its entropy new for every connection)
    if (options.handoff !== undefined) {
      const time = yield* Clock.currentTimeMillis
      yield* link.send({
        type: "session",
        config: options.handoff.config,
        time,
        entropy: crypto.randomBytes(64).toString("base64"),
        ...(options.handoff.repoDisks === true ? { repoDisks: true } : {})
      })
    }
    // a VM restored from its saved memory: the guest speaks once it hears `resumed`
    if (resumed !== undefined) {
      const unixMillis = yield* Clock.currentTimeMillis
      yield* link.send({
        type: "resumed",
        unixMillis,
        entropy: crypto.randomBytes(64).toString("base64"),
        ...(resumed.brokerCaCert === undefined ? {} : { brokerCaCert: resumed.brokerCaCert })
      })
    }
    // a failed handshake closes the connection at once
    const hello = yield* handshake(link, dispatcher, options.helloTimeout).pipe(
      Effect.tapError(() => link.close)
    )

    // channel ids the host opens: even, counting up (the guest's tunnels are odd)
    // (after a resume: above what the host opened before, ids are never reused)
    let nextChannel = hello.hostChannel === undefined ? 2 : hello.hostChannel + 2 - (hello.hostChannel % 2)
    const channelId = () => {
      const id = nextChannel
      nextChannel += 2
      return id
    }
    const { transfer, exportTree } = makeTransfers(
      link,
      dispatcher,
      hello,
      channelId,
      options.transferEndTimeout
    )
    const { turn, ttyTurn, cancel } = makeTurns(link, dispatcher, hello, channelId)
    return {
      hello,
      transfer,
      exportTree,
      turn,
      ttyTurn,
      cancel,
      shutdown,
      tunnels: Stream.fromQueue(dispatcher.tunnels),
      forward: makeForward(link, dispatcher, channelId)
    } satisfies GuestConnection
  })
