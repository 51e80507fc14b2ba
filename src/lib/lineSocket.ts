// Raw node:net: a control connection (docs/detached.md) begins with one handshake line each way,
// then carries RPC messages (@effect/rpc over @effect/platform's Socket, `duplexAfter`) or raw
// bytes (`forward`), which @effect/platform's Socket does not hand out. This is the one adapter at
// that boundary: lines in as an Effect per line, lines out as an Effect per write.
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Queue from "effect/Queue"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as net from "node:net"
import { Duplex, PassThrough } from "node:stream"
import { ControlError, MAX_CONTROL_LINE } from "../protocol/Control.js"
import { errorMessage } from "../domain/errorMessage.js"
import { listenUnixServer } from "./unixServer.js"

/**
 * A unix socket read as lines (each at most `max` bytes) until the caller takes it raw. What it
 * holds unread is bounded: past `max` bytes the socket is paused (the peer's writes wait in the
 * kernel) until the reader has taken lines again, so a peer that floods lines faster than they
 * are read, or while nobody reads, costs at most `max` plus one chunk. Chunks are kept as they
 * came (a line is copied only when it spans chunks), not joined into one buffer per chunk.
 */
export class LineSocket {
  /** the unread bytes, in order: `head` first, then `rest` */
  private head: Buffer = Buffer.alloc(0)
  private rest: Array<Buffer> = []
  /** how many chunks of `rest` are known to hold no newline */
  private scanned = 0
  private buffered = 0
  private paused = false
  private ended = false
  private failure: Error | undefined
  private waiter: (() => void) | undefined
  private readonly onData = (chunk: Buffer) => {
    if (this.head.length === 0 && this.rest.length === 0) this.head = chunk
    else this.rest.push(chunk)
    this.buffered += chunk.length
    if (this.buffered > this.max && !this.paused) {
      this.paused = true
      this.socket.pause()
    }
    this.wake()
  }
  private readonly onEnd = () => {
    this.ended = true
    this.wake()
  }
  private readonly onError = (error: Error) => {
    this.failure = error
    this.ended = true
    this.wake()
  }

  constructor(
    readonly socket: net.Socket,
    private readonly max: number = MAX_CONTROL_LINE
  ) {
    socket.on("data", this.onData)
    socket.on("end", this.onEnd)
    socket.on("close", this.onEnd)
    socket.on("error", this.onError)
  }

  private wake() {
    const resolve = this.waiter
    this.waiter = undefined
    resolve?.()
  }

  /** the next line (without its newline), or undefined at the end of the stream */
  async next(): Promise<string | undefined> {
    for (;;) {
      const newline = this.head.indexOf(10)
      if (newline >= 0) {
        const line = this.head.subarray(0, newline).toString("utf8")
        this.head = this.head.subarray(newline + 1)
        this.buffered -= newline + 1
        if (this.head.length === 0 && this.rest.length > 0) {
          this.head = this.rest.shift()!
          this.scanned = 0
        }
        if (this.paused && this.buffered <= this.max && !this.socket.destroyed) {
          this.paused = false
          this.socket.resume()
        }
        return line
      }
      // the line goes on in later chunks: joined once, when its end is in
      while (this.scanned < this.rest.length && this.rest[this.scanned]!.indexOf(10) < 0) this.scanned++
      if (this.scanned < this.rest.length) {
        this.head = Buffer.concat([this.head, ...this.rest.splice(0, this.scanned + 1)])
        this.scanned = 0
        continue
      }
      if (this.buffered > this.max) throw new Error(`a line longer than ${this.max} bytes`)
      if (this.ended) {
        if (this.failure !== undefined) throw this.failure
        return undefined
      }
      await new Promise<void>((resolve) => (this.waiter = resolve))
    }
  }

  /** leave line mode: the bytes read past the last line; the socket is paused for the caller */
  takeRaw(): Buffer {
    this.socket.off("data", this.onData)
    this.socket.pause()
    const rest = Buffer.concat([this.head, ...this.rest])
    this.head = Buffer.alloc(0)
    this.rest = []
    this.scanned = 0
    this.buffered = 0
    return rest
  }

  get closed(): boolean {
    return this.socket.destroyed
  }
}

/**
 * The socket after its handshake line, as one Duplex: what LineSocket had read past the line
 * first, then the socket's bytes; writes go to the socket. Its readable side holds the bytes
 * until a reader takes them (nothing is lost between the handshake and the next reader).
 */
export const duplexAfter = (lines: LineSocket): Duplex => {
  const rest = lines.takeRaw()
  const socket = lines.socket
  const readable = new PassThrough()
  if (rest.length > 0) readable.write(rest)
  socket.pipe(readable)
  // a socket that closes without its end (reset, destroyed) ends the readable side too
  socket.once("close", () => readable.end())
  socket.resume()
  const duplex = Duplex.from({ readable, writable: socket })
  duplex.once("close", () => socket.destroy())
  // a reset or a destroy ends the stream; its reader sees that as the close (no unhandled error)
  const ignore = () => undefined
  duplex.on("error", ignore)
  socket.on("error", ignore)
  return duplex
}

/** one line, as an Effect: None at the end of the stream */
export const readLine = (lines: LineSocket): Effect.Effect<Option.Option<string>, ControlError> =>
  Effect.tryPromise({
    try: () => lines.next(),
    catch: (cause) => new ControlError({ reason: "read", message: `control socket: ${errorMessage(cause)}` })
  }).pipe(Effect.map((line) => Option.fromNullable(line)))

/** every line until the end of the stream */
export const readLines = (lines: LineSocket): Stream.Stream<string, ControlError> =>
  Stream.repeatEffectOption(
    readLine(lines).pipe(
      Effect.mapError((error) => Option.some(error)),
      Effect.flatMap(Option.match({ onNone: () => Effect.fail(Option.none()), onSome: Effect.succeed }))
    )
  )

/** write one line; waits until the socket took it (back pressure) */
export const writeLine = (socket: net.Socket, line: string): Effect.Effect<void, ControlError> =>
  writeBytes(socket, line + "\n")

/** write bytes; waits until the socket took them (back pressure) */
export const writeBytes = (
  socket: net.Socket,
  data: string | Uint8Array
): Effect.Effect<void, ControlError> =>
  Effect.async<void, ControlError>((resume) => {
    if (socket.destroyed || !socket.writable) {
      resume(Effect.fail(new ControlError({ reason: "closed", message: "the control connection is closed" })))
      return
    }
    socket.write(data, (error) =>
      resume(
        error === undefined || error === null
          ? Effect.void
          : Effect.fail(
              new ControlError({ reason: "write", message: `control socket: ${errorMessage(error)}` })
            )
      )
    )
  })

/** connect to a unix socket; `refused` tells a stale socket file (nobody listening) from other errors */
export const connectUnix = (
  socketPath: string
): Effect.Effect<net.Socket, { readonly refused: boolean; readonly message: string }> =>
  Effect.async((resume) => {
    // half-open: a forward passes each direction's end on by itself
    const socket = net.connect({ path: socketPath, allowHalfOpen: true })
    const onError = (error: NodeJS.ErrnoException) => {
      socket.destroy()
      resume(
        Effect.fail({
          refused: error.code === "ECONNREFUSED" || error.code === "ENOENT",
          message: `${socketPath}: ${error.message}`
        })
      )
    }
    socket.once("error", onError)
    socket.once("connect", () => {
      socket.off("error", onError)
      resume(Effect.succeed(socket))
    })
    return Effect.sync(() => socket.destroy())
  })

/**
 * Listens on a unix socket path, 0600 (a stale file removed, a live one `busy`: listenUnixServer).
 * Accepted connections come out of the returned queue; the server closes (and the file is
 * removed) with the scope.
 */
export const listenUnix = (socketPath: string) =>
  Effect.gen(function* () {
    const connections = yield* Effect.acquireRelease(Queue.unbounded<net.Socket>(), (queue) =>
      Effect.flatMap(Queue.takeAll(queue), (sockets) =>
        Effect.sync(() => Chunk.forEach(sockets, (s) => s.destroy()))
      ).pipe(Effect.zipRight(Queue.shutdown(queue)))
    )
    yield* Effect.acquireRelease(
      listenUnixServer(socketPath, { allowHalfOpen: true }, (socket) => {
        if (!Queue.unsafeOffer(connections, socket)) socket.destroy()
      }).pipe(
        Effect.mapError(
          ({ message, reason }) =>
            new ControlError({ reason: reason === "chmod" ? "listen" : reason, message })
        )
      ),
      // no new connections; those still open are their handlers' to end (not waited for here)
      (server) =>
        Effect.sync(() => {
          server.close()
          try {
            fs.unlinkSync(socketPath)
          } catch {
            // already gone
          }
        })
    )
    return connections as Queue.Dequeue<net.Socket>
  })

/** the bytes a socket receives, from now until its end */
export const socketBytes = (socket: net.Socket): Stream.Stream<Uint8Array, ControlError> =>
  Stream.fromAsyncIterable(
    // not destroyed at the end of the iteration: the other direction may still be writing
    {
      [Symbol.asyncIterator]: () => socket.iterator({ destroyOnReturn: false }) as AsyncIterator<Uint8Array>
    },
    (cause) => new ControlError({ reason: "read", message: `socket: ${errorMessage(cause)}` })
  )

/**
 * Listens on 127.0.0.1:<port> (0: any free port); accepted connections come out of the queue;
 * the server closes with the scope.
 */
export const listenLoopback = (port: number) =>
  Effect.gen(function* () {
    const connections = yield* Effect.acquireRelease(Queue.unbounded<net.Socket>(), (queue) =>
      Effect.flatMap(Queue.takeAll(queue), (sockets) =>
        Effect.sync(() => Chunk.forEach(sockets, (s) => s.destroy()))
      ).pipe(Effect.zipRight(Queue.shutdown(queue)))
    )
    const server = yield* Effect.acquireRelease(
      Effect.async<net.Server, ControlError>((resume) => {
        const server = net.createServer({ allowHalfOpen: true }, (socket) => {
          if (!Queue.unsafeOffer(connections, socket)) socket.destroy()
        })
        server.once("error", (cause) =>
          resume(
            Effect.fail(
              new ControlError({ reason: "listen", message: `127.0.0.1:${port}: ${errorMessage(cause)}` })
            )
          )
        )
        server.listen(port, "127.0.0.1", () => resume(Effect.succeed(server)))
      }),
      (server) => Effect.sync(() => server.close())
    )
    const address = server.address()
    return {
      connections: connections as Queue.Dequeue<net.Socket>,
      port: typeof address === "object" && address !== null ? address.port : port
    }
  })

/** two sockets joined both ways (each end passed on), until both are closed; `first` goes to `b` first */
export const splice = (a: net.Socket, b: net.Socket, first: Uint8Array): Effect.Effect<void> =>
  Effect.async<void>((resume) => {
    let closed = 0
    const onClose = () => {
      if (++closed === 2) resume(Effect.void)
    }
    a.once("close", onClose)
    b.once("close", onClose)
    a.on("error", () => b.destroy())
    b.on("error", () => a.destroy())
    if (first.length > 0) b.write(first)
    a.pipe(b)
    b.pipe(a)
    return Effect.sync(() => {
      a.destroy()
      b.destroy()
    })
  })
