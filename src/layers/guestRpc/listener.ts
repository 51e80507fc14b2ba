/**
 * The listener: binds the session's rpc.sock (0600, a stale file from a killed process is
 * removed, a live one refused) and hands out the connections the VMM makes to it, paused.
 */
import * as Chunk from "effect/Chunk"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Queue from "effect/Queue"
// Raw node:net here: the Mux runs over a Node Duplex (the same code the guest uses), which
// @effect/platform's Socket does not hand out.
import * as fs from "node:fs"
import type * as net from "node:net"
import { listenUnixServer } from "../../lib/unixServer.js"
import { GuestDisconnected, GuestTimeout } from "../../services/GuestRpc.js"

export const bindListener = Effect.fn("GuestRpc.bind")(function* (socketPath: string) {
  const connections = yield* Effect.acquireRelease(Queue.sliding<net.Socket>(4), (queue) =>
    Effect.flatMap(Queue.takeAll(queue), (sockets) =>
      Effect.sync(() => Chunk.forEach(sockets, (s) => s.destroy()))
    ).pipe(Effect.zipRight(Queue.shutdown(queue)))
  )
  yield* Effect.acquireRelease(
    listenUnixServer(socketPath, { pauseOnConnect: true }, (socket) => {
      if (!Queue.unsafeOffer(connections, socket)) socket.destroy()
    }).pipe(Effect.mapError(({ message }) => new GuestDisconnected({ message }))),
    // a connection still queued (the VM connected, nobody accepted: a restore that failed) is
    // destroyed first: the server's close waits for every connection to end
    (server) =>
      Effect.flatMap(Queue.takeAll(connections), (sockets) =>
        Effect.sync(() => Chunk.forEach(sockets, (s) => s.destroy()))
      ).pipe(
        Effect.zipRight(
          Effect.async<void>((resume) => {
            server.close(() => resume(Effect.void))
          })
        ),
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
