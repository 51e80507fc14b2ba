/**
 * The supervisor's side of @effect/rpc's server protocol (`RpcServer.Protocol`) on control
 * connections that passed their handshake (programs/supervisor.ts), NDJSON in
 * `controlSerialization`. What it adds to RpcServer's own socket protocol is a bound per
 * connection: at most MAX_IN_FLIGHT requests the server has not answered yet. RpcServer runs
 * each request in a fiber of its own and returns at once, and its socket protocol reads on
 * regardless, so a client that sends requests faster than their replies leave (a flood, or a
 * client that never reads its replies) grew the supervisor's memory without end. Here, past the
 * bound, the connection's next bytes are not read until a request is answered: the client's
 * writes wait in the kernel, then in the client. A stream past its bound is refused instead (its
 * call fails with that reason): a stream waits for its client's acknowledgements, which come on
 * this connection, so waiting to read them would stall it.
 *
 * A line that is not a message, a request of an unknown tag or of a bad or busy id: the client
 * is told (a `Defect` message, which fails its calls) and the connection is closed; its turns
 * go on, as for a client that went away.
 */
import type * as RpcMessage from "@effect/rpc/RpcMessage"
import * as RpcSchema from "@effect/rpc/RpcSchema"
import * as RpcServer from "@effect/rpc/RpcServer"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Mailbox from "effect/Mailbox"
import * as Stream from "effect/Stream"
import type { Duplex } from "node:stream"
import { ControlError } from "../protocol/Control.js"
import { ControlRpcs, controlSerialization } from "../services/ControlRpc.js"

/** a connection's unanswered requests (other than streams) before it waits */
export const MAX_IN_FLIGHT = 16
/** a connection's streams not ended (turns, attaches, diffs) before another is refused */
export const MAX_STREAMS = 64

/** what a refused connection is told, at most this long before it is closed anyway */
const REFUSAL_WRITE = Duration.seconds(5)

/** a protocol-level refusal of a connection (its reason goes to the client as a Defect) */
const refused = (message: string) => new ControlError({ reason: "bad request", message })

/** one write, done when the socket took it (a client that does not read makes it wait) */
const writeTo = (duplex: Duplex, text: string): Effect.Effect<void> =>
  Effect.async<void>((resume) => {
    if (duplex.destroyed || !duplex.writable) return resume(Effect.void)
    duplex.write(text, () => resume(Effect.void))
  })

/** lines decoded at once */
const LINES_PER_PIECE = 8

/** `chunk` cut after every LINES_PER_PIECE-th newline (views, not copies) */
const pieces = (chunk: Uint8Array): Array<Uint8Array> => {
  const out: Array<Uint8Array> = []
  let start = 0
  let lines = 0
  for (let at = chunk.indexOf(10); at !== -1; at = chunk.indexOf(10, at + 1)) {
    if (++lines < LINES_PER_PIECE) continue
    out.push(chunk.subarray(start, at + 1))
    start = at + 1
    lines = 0
  }
  if (start < chunk.length) out.push(chunk.subarray(start))
  return out
}

/**
 * The protocol, for `RpcServer.make(ControlRpcs)`, and `serve`, which runs one connection on it
 * until the connection ends (or the scope closes).
 */
export const makeControlProtocol = Effect.gen(function* () {
  const disconnects = yield* Mailbox.make<number>()
  const connections = new Map<number, (response: RpcMessage.FromServerEncoded) => Effect.Effect<void>>()
  let writeRequest: (clientId: number, message: RpcMessage.FromClientEncoded) => Effect.Effect<void> = () =>
    Effect.void
  const protocol = yield* RpcServer.Protocol.make((write) => {
    writeRequest = write
    return Effect.succeed({
      disconnects,
      send: (clientId: number, response: RpcMessage.FromServerEncoded) =>
        connections.get(clientId)?.(response) ?? Effect.void,
      end: () => Effect.void,
      clientIds: Effect.sync(() => new Set(connections.keys())),
      initialMessage: Effect.succeedNone,
      supportsAck: true,
      supportsTransferables: false,
      supportsSpanPropagation: false
    })
  })
  let nextId = 0

  const serve = (duplex: Duplex) =>
    Effect.gen(function* () {
      const id = nextId++
      const parser = controlSerialization.unsafeMake()
      const permits = yield* Effect.makeSemaphore(MAX_IN_FLIGHT)
      // the requests holding a permit, by id: released when their Exit has been written
      const inFlight = new Set<string>()
      // the streams not ended, by id
      const streams = new Set<string>()
      const encodeLine = (message: RpcMessage.FromServerEncoded) => parser.encode(message) as string
      const write = (message: RpcMessage.FromServerEncoded) => writeTo(duplex, encodeLine(message))
      connections.set(id, (response) => {
        if (response._tag === "Exit" && streams.delete(response.requestId)) return write(response)
        if (response._tag !== "Exit" || !inFlight.delete(response.requestId)) return write(response)
        return Effect.zipRight(write(response), permits.release(1))
      })
      yield* Effect.addFinalizer(() =>
        Effect.suspend(() => {
          connections.delete(id)
          return disconnects.offer(id)
        })
      )
      const refuse = (error: ControlError) =>
        writeTo(duplex, encodeLine({ _tag: "Defect", defect: error.message })).pipe(
          Effect.timeout(REFUSAL_WRITE),
          Effect.ignore,
          Effect.zipRight(Effect.fail(error))
        )
      const take = (message: RpcMessage.FromClientEncoded) =>
        Effect.gen(function* () {
          if (message._tag === "Request") {
            const rpc = ControlRpcs.requests.get(message.tag)
            if (typeof message.id !== "string" || rpc === undefined)
              return yield* refuse(refused(`not a request of the control plane: ${String(message.tag)}`))
            if (inFlight.has(message.id) || streams.has(message.id))
              return yield* refuse(refused(`request id ${message.id} is in use`))
            if (RpcSchema.isStreamSchema(rpc.successSchema)) {
              if (streams.size >= MAX_STREAMS)
                return yield* write({
                  _tag: "Exit",
                  requestId: message.id,
                  exit: {
                    _tag: "Failure",
                    cause: {
                      _tag: "Die",
                      defect: `more than ${MAX_STREAMS} streams on one control connection`
                    }
                  }
                })
              streams.add(message.id)
            } else {
              // past the bound, wait (nothing more is read) until one of this connection's is answered
              yield* permits.take(1)
              inFlight.add(message.id)
            }
          }
          yield* writeRequest(id, message)
        })
      const decodeAndTake = (piece: Uint8Array) =>
        Effect.suspend(() => {
          let messages: ReadonlyArray<unknown>
          try {
            messages = parser.decode(piece)
          } catch (cause) {
            const reason = (cause as { readonly message?: unknown } | undefined)?.message
            return refuse(refused(typeof reason === "string" ? reason : String(cause)))
          }
          return Effect.forEach(messages as ReadonlyArray<RpcMessage.FromClientEncoded>, take, {
            discard: true
          })
        })
      yield* Stream.fromAsyncIterable(duplex as AsyncIterable<Uint8Array>, () =>
        refused("the control connection failed")
      ).pipe(
        // a chunk is decoded a few lines at a time, each piece's messages taken before the next
        // is parsed: a chunk of many small requests is not held as that many messages meanwhile
        Stream.runForEach((chunk) => Effect.forEach(pieces(chunk), decodeAndTake, { discard: true })),
        // an interrupted read (the session closing) finishes in the background: the iterator's
        // return() waits for the stream to end, which it does once the connection's finalizer has
        // destroyed the socket, not while this fiber holds that finalizer back
        Effect.disconnect
      )
      // the client's end: what it asked for runs on until the connection closes (RpcServer's
      // disconnect then interrupts its requests)
      yield* writeRequest(id, { _tag: "Eof" })
    })

  return { protocol, serve } as const
})
