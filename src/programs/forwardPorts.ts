/**
 * The environment's forwarded ports in a detached session (docs/environments.md): the session's
 * host (the supervisor) listens on 127.0.0.1:<port> of the host for each `forward` port (never
 * another address), and each connection goes to 127.0.0.1:<port> in the guest over a protocol
 * channel, as `abox forward` does. A host port already taken is told (`refused`, with the
 * command that picks another), never a failed start. The listeners and `forwards.json` (what
 * `abox show` and `abox start` list) go with the session's scope: when the session stops.
 */
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Queue from "effect/Queue"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"
import * as fs from "node:fs/promises"
import type * as net from "node:net"
import * as path from "node:path"
import { ForwardsFile } from "../domain/environment.js"
import { errorMessage } from "../domain/errorMessage.js"
import { SESSION_FILES } from "../domain/sessionLayout.js"
import { writeJsonAtomic } from "../lib/atomicFile.js"
import { readEnvironment } from "../lib/environment.js"
import { listenLoopback, socketBytes, writeBytes } from "../lib/lineSocket.js"
import type { ForwardChannel } from "../services/GuestRpc.js"
import type { Session } from "./session.js"

/**
 * A TCP connection and a guest channel joined both ways: `first` (bytes already read from the
 * socket) goes to the guest first; each direction's end is passed on as an EOF.
 */
export const spliceChannel = (socket: net.Socket, channel: ForwardChannel, first: Uint8Array = new Uint8Array()) =>
  Effect.all(
    [
      Effect.gen(function* () {
        if (first.length > 0) yield* channel.write(first)
        yield* Stream.runForEach(socketBytes(socket), (chunk) => channel.write(chunk))
        yield* channel.end
      }),
      Stream.runForEach(channel.read, (chunk) => writeBytes(socket, chunk)).pipe(
        Effect.zipRight(Effect.sync(() => socket.end()))
      )
    ],
    { concurrency: 2, discard: true }
  )

/**
 * Forwards `ports` of `session` to the same ports of the host's loopback, for as long as the
 * caller's scope lasts; writes `forwards.json` in the session's directory (removed with the
 * scope). `ref` is how the user names the session (for the hint when a port is taken).
 */
export const forwardPorts = Effect.fn("forward.ports")(function* (
  session: Session,
  ports: ReadonlyArray<number>,
  ref: string
) {
  const forwarded: Array<{ guestPort: number; hostPort: number }> = []
  const refused: Array<{ guestPort: number; message: string }> = []
  for (const port of new Set(ports)) {
    const listener = yield* Effect.either(listenLoopback(port))
    if (listener._tag === "Left") {
      refused.push({
        guestPort: port,
        message: `guest port ${port} not forwarded: the host's ${listener.left.message} (taken, or not yours to listen on); abox forward ${ref} ${port} <another host port> forwards it there`
      })
      continue
    }
    forwarded.push({ guestPort: port, hostPort: listener.right.port })
    const one = (tcp: net.Socket) =>
      Effect.gen(function* () {
        yield* Effect.addFinalizer(() => Effect.sync(() => tcp.destroy()))
        const channel = yield* session.connection.forward(port)
        yield* spliceChannel(tcp, channel)
      }).pipe(
        Effect.scoped,
        // nothing listens on that port in the guest (yet), or the VM went away: this connection ends
        Effect.catchAll((error) => Effect.logDebug(`forward ${port}: ${errorMessage(error)}`))
      )
    yield* Queue.take(listener.right.connections).pipe(
      Effect.flatMap((tcp) => Effect.forkScoped(one(tcp))),
      Effect.forever,
      Effect.forkScoped
    )
  }
  const file = path.join(session.dir, SESSION_FILES.forwards)
  const listing: ForwardsFile = { forwarded, refused }
  // the listing is for show and start; the ports are forwarded even when it cannot be written
  yield* Effect.acquireRelease(
    writeJsonAtomic(file, ForwardsFile, listing).pipe(
      Effect.catchAll((error) => Effect.logWarning(`${file}: ${error.message}`))
    ),
    () => Effect.promise(() => fs.rm(file, { force: true }))
  )
  return listing
})

const decodeForwards = Schema.decodeUnknownOption(Schema.parseJson(ForwardsFile))

/** a session's `forwards.json` (only meaningful while its supervisor runs); none when absent or unreadable */
export const readForwards = (dir: string): Effect.Effect<Option.Option<ForwardsFile>> =>
  Effect.promise(() =>
    fs.readFile(path.join(dir, SESSION_FILES.forwards), "utf8").then(
      (text) => decodeForwards(text),
      () => Option.none<ForwardsFile>()
    )
  )

/**
 * At the start of a detached session: the ports the repository's environment file (at the
 * session's source) asks to forward, forwarded (`forwardPorts`); an environment that no longer
 * reads is told and forwards nothing. The caller skips it when `--image` overrode the environment.
 */
export const forwardEnvironmentPorts = Effect.fn("forward.environment")(function* (
  session: Session,
  ref: string,
  onNotice: (line: string) => Effect.Effect<void>
) {
  const environment = yield* readEnvironment(session.meta.source).pipe(
    Effect.catchAll((error) => Effect.as(onNotice(`${error.message}: no port forwarded`), undefined))
  )
  const ports = environment?.forward ?? []
  if (ports.length === 0) return undefined
  const listing = yield* forwardPorts(session, ports, ref)
  for (const { guestPort, hostPort } of listing.forwarded)
    yield* onNotice(`forwarding 127.0.0.1:${hostPort} -> guest port ${guestPort} (${environment!.file})`)
  for (const { message } of listing.refused) yield* onNotice(message)
  return listing
})
