// Raw node:net / node:fs: the socket file needs a liveness probe before a stale one is unlinked,
// and mode 0600, neither of which @effect/platform's socket server offers.
import * as Effect from "effect/Effect"
import * as fs from "node:fs"
import * as net from "node:net"
import { errorMessage } from "../domain/errorMessage.js"

/** why a unix socket could not be listened on; `message` starts with the socket's path */
export interface UnixListenFailure {
  readonly reason: "busy" | "stale" | "listen" | "chmod"
  readonly message: string
}

/** is something accepting connections on this unix socket path? */
const probe = (socketPath: string): Effect.Effect<boolean> =>
  Effect.async<boolean>((resume) => {
    const socket = net.connect(socketPath)
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

/**
 * A server listening on a unix socket path, 0600 (created so under a umask, then made sure of).
 * A socket file already there is probed: someone listening → `busy`; nobody (a stale file left
 * by a killed process) → removed first (`stale` if it cannot be). Closing the server and removing
 * the file are the caller's (its release: the control socket and the guest's socket close
 * differently).
 */
export const listenUnixServer = (
  socketPath: string,
  options: net.ServerOpts,
  onConnection: (socket: net.Socket) => void
): Effect.Effect<net.Server, UnixListenFailure> =>
  Effect.gen(function* () {
    if (yield* Effect.sync(() => fs.existsSync(socketPath))) {
      if (yield* probe(socketPath)) {
        return yield* Effect.fail<UnixListenFailure>({
          reason: "busy",
          message: `${socketPath}: another process is listening on it`
        })
      }
      yield* Effect.try({
        try: () => fs.unlinkSync(socketPath),
        catch: (cause): UnixListenFailure => ({
          reason: "stale",
          message: `${socketPath}: cannot remove the stale socket: ${errorMessage(cause)}`
        })
      })
    }
    return yield* Effect.async<net.Server, UnixListenFailure>((resume) => {
      const server = net.createServer(options, onConnection)
      server.once("error", (cause) =>
        resume(Effect.fail({ reason: "listen", message: `${socketPath}: ${errorMessage(cause)}` }))
      )
      // created 0600 from the start (umask; the bind happens within listen()), then made sure of it
      const umask = process.umask(0o177)
      server.listen(socketPath, () => {
        try {
          fs.chmodSync(socketPath, 0o600)
        } catch (cause) {
          server.close()
          resume(Effect.fail({ reason: "chmod", message: `${socketPath}: chmod: ${errorMessage(cause)}` }))
          return
        }
        resume(Effect.succeed(server))
      })
      process.umask(umask)
    })
  })
