import * as Data from "effect/Data"
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Schema from "effect/Schema"
// Raw node:net: the helper is a small bundle on the start-up path of every VM; a unix socket
// line protocol needs nothing more.
import * as net from "node:net"

/** A QMP reply line: greeting, command return, error, or an asynchronous event. */
const QmpLine = Schema.Union(
  Schema.Struct({ QMP: Schema.Unknown }),
  Schema.Struct({ return: Schema.Unknown }),
  Schema.Struct({ error: Schema.Struct({ class: Schema.String, desc: Schema.String }) }),
  Schema.Struct({ event: Schema.String })
)
const decodeLine = Schema.decodeUnknownEither(Schema.parseJson(QmpLine))

export class QmpError extends Data.TaggedError("QmpError")<{
  readonly reason: string
  readonly cause?: unknown
}> {
  override get message() {
    return `QMP: ${this.reason}`
  }
}

/**
 * Run one QMP command (after the capabilities handshake) and return its `return` value.
 * `quit` may close the socket before answering; that counts as success.
 */
export const qmpCommand = (
  socketPath: string,
  execute: string,
  timeout: Duration.DurationInput = "2 seconds"
) =>
  Effect.async<unknown, QmpError>((resume) => {
    const socket = net.connect(socketPath)
    let buffered = ""
    let stage: "greeting" | "capabilities" | "command" = "greeting"
    let done = false
    const finish = (result: Either.Either<unknown, QmpError>) => {
      if (done) return
      done = true
      socket.destroy()
      resume(Either.isRight(result) ? Effect.succeed(result.right) : Effect.fail(result.left))
    }
    socket.setEncoding("utf8")
    socket.on("error", (cause) => finish(Either.left(new QmpError({ reason: cause.message, cause }))))
    socket.on("close", () =>
      finish(
        execute === "quit" && stage === "command"
          ? Either.right(null)
          : Either.left(new QmpError({ reason: "closed" }))
      )
    )
    socket.on("data", (chunk: string) => {
      buffered += chunk
      let newline = buffered.indexOf("\n")
      while (newline !== -1) {
        const line = buffered.slice(0, newline).trim()
        buffered = buffered.slice(newline + 1)
        newline = buffered.indexOf("\n")
        if (line === "") continue
        const decoded = decodeLine(line)
        if (Either.isLeft(decoded))
          return finish(Either.left(new QmpError({ reason: `bad line: ${line.slice(0, 200)}` })))
        const message = decoded.right
        if ("event" in message) continue
        if ("error" in message)
          return finish(
            Either.left(new QmpError({ reason: `${message.error.class}: ${message.error.desc}` }))
          )
        if (stage === "greeting" && "QMP" in message) {
          stage = "capabilities"
          socket.write(JSON.stringify({ execute: "qmp_capabilities" }) + "\n")
        } else if (stage === "capabilities" && "return" in message) {
          stage = "command"
          socket.write(JSON.stringify({ execute }) + "\n")
        } else if (stage === "command" && "return" in message) {
          return finish(Either.right(message.return))
        }
      }
    })
    return Effect.sync(() => {
      done = true
      socket.destroy()
    })
  }).pipe(
    Effect.timeoutFail({
      duration: timeout,
      onTimeout: () => new QmpError({ reason: `${execute}: no answer in time` })
    })
  )
