/**
 * The listener: binds the session's rpc.sock (0600, a stale file from a killed process is
 * removed, a live one refused) and hands out the connections the VMM makes to it, paused.
 */
import * as Chunk from "effect/Chunk"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Queue from "effect/Queue"
// Raw node:net / node:fs here: the Mux runs over a Node Duplex (the same code the guest uses),
// which @effect/platform's Socket does not hand out; the socket file needs chmod 0600 and a
// liveness probe before a stale file is unlinked.
import * as fs from "node:fs"
import * as net from "node:net"
import { errorMessage } from "../../domain/errorMessage.js"
import { GuestDisconnected, GuestTimeout } from "../../services/GuestRpc.js"

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

export const bindListener = Effect.fn("GuestRpc.bind")(function* (socketPath: string) {
  const exists = yield* Effect.sync(() => fs.existsSync(socketPath))
  if (exists) {
    if (yield* probe(socketPath)) {
      return yield* new GuestDisconnected({ message: `${socketPath}: another process is listening on it` })
    }
    yield* Effect.try({
      try: () => fs.unlinkSync(socketPath),
      catch: (cause) =>
        new GuestDisconnected({
          message: `${socketPath}: cannot remove the stale socket: ${errorMessage(cause)}`
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
          Effect.fail(new GuestDisconnected({ message: `${socketPath}: cannot listen: ${errorMessage(cause)}` }))
        )
      )
      server.listen(socketPath, () => {
        try {
          // the session directory is 0700 already; the socket itself is 0600 as well
          fs.chmodSync(socketPath, 0o600)
        } catch (cause) {
          server.close()
          resume(Effect.fail(new GuestDisconnected({ message: `${socketPath}: chmod: ${errorMessage(cause)}` })))
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

/** the next connection, within `helloTimeout` (it is the guest's first sign of life) */
export const nextConnection = (
  connections: Queue.Dequeue<net.Socket>,
  helloTimeout: Duration.DurationInput
): Effect.Effect<net.Socket, GuestTimeout> =>
  Queue.take(connections).pipe(
    Effect.timeoutFail({
      duration: helloTimeout,
      onTimeout: () =>
        new GuestTimeout({
          waitingFor: "hello",
          message: `the guest did not connect within ${Duration.format(helloTimeout)}`
        })
    })
  )
