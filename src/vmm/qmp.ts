// Raw node:net, no Effect: the QMP client runs inside the abox-vmm helper, a small plain-node
// process on every VM's start-up path; a unix socket line protocol needs nothing more.
import * as net from "node:net"

export class QmpError extends Error {
  readonly _tag = "QmpError"
  constructor(
    readonly reason: string,
    options?: { readonly cause?: unknown }
  ) {
    super(`QMP: ${reason}`, options)
  }
}

type QmpLine =
  | { readonly QMP: unknown }
  | { readonly return: unknown }
  | { readonly error: { readonly class: string; readonly desc: string } }
  | { readonly event: string }

/** A QMP reply line: greeting, command return, error, or an asynchronous event; else undefined. */
const decodeLine = (line: string): QmpLine | undefined => {
  let value: unknown
  try {
    value = JSON.parse(line)
  } catch {
    return undefined
  }
  if (typeof value !== "object" || value === null || Array.isArray(value)) return undefined
  const message = value as Record<string, unknown>
  if ("QMP" in message || "return" in message) return message as QmpLine
  if ("error" in message) {
    const error = message["error"]
    return typeof error === "object" &&
      error !== null &&
      typeof (error as Record<string, unknown>)["class"] === "string" &&
      typeof (error as Record<string, unknown>)["desc"] === "string"
      ? (message as QmpLine)
      : undefined
  }
  if (typeof message["event"] === "string") return message as QmpLine
  return undefined
}

/**
 * Run one QMP command (after the capabilities handshake; `args` are its `arguments`) and resolve with its `return` value;
 * rejects with a QmpError (the socket fails or closes, QEMU answers an error or a line that is
 * not QMP, or no answer within `timeoutMs`). `quit` may close the socket before answering; that
 * counts as success. The socket is always destroyed when it settles.
 */
export const qmpCommand = (
  socketPath: string,
  execute: string,
  timeoutMs = 2000,
  args?: Readonly<Record<string, unknown>>
): Promise<unknown> =>
  new Promise((resolve, reject) => {
    const socket = net.connect(socketPath)
    let buffered = ""
    let stage: "greeting" | "capabilities" | "command" = "greeting"
    let done = false
    const finish = (error: QmpError | undefined, value?: unknown) => {
      if (done) return
      done = true
      clearTimeout(timer)
      socket.destroy()
      if (error === undefined) resolve(value)
      else reject(error)
    }
    const timer = setTimeout(() => finish(new QmpError(`${execute}: no answer in time`)), timeoutMs)
    socket.setEncoding("utf8")
    socket.on("error", (cause) => finish(new QmpError(cause.message, { cause })))
    socket.on("close", () =>
      execute === "quit" && stage === "command" ? finish(undefined, null) : finish(new QmpError("closed"))
    )
    socket.on("data", (chunk: string) => {
      buffered += chunk
      let newline = buffered.indexOf("\n")
      while (newline !== -1) {
        const line = buffered.slice(0, newline).trim()
        buffered = buffered.slice(newline + 1)
        newline = buffered.indexOf("\n")
        if (line === "") continue
        const message = decodeLine(line)
        if (message === undefined) return finish(new QmpError(`bad line: ${line.slice(0, 200)}`))
        if ("event" in message) continue
        if ("error" in message) return finish(new QmpError(`${message.error.class}: ${message.error.desc}`))
        if (stage === "greeting" && "QMP" in message) {
          stage = "capabilities"
          socket.write(JSON.stringify({ execute: "qmp_capabilities" }) + "\n")
        } else if (stage === "capabilities" && "return" in message) {
          stage = "command"
          socket.write(JSON.stringify(args === undefined ? { execute } : { execute, arguments: args }) + "\n")
        } else if (stage === "command" && "return" in message) {
          return finish(undefined, message.return)
        }
      }
    })
  })

/** one QMP connection for a sequence of commands (migration: set parameters, stop, migrate, poll) */
export interface QmpClient {
  /** the command's `return`; rejects with a QmpError (an error answer, the socket closing, no answer in time) */
  readonly execute: (command: string, args?: Record<string, unknown>, timeoutMs?: number) => Promise<unknown>
  readonly close: () => void
}

/**
 * Connect to a QMP socket and finish the capabilities handshake within `timeoutMs`. Commands
 * run one after the other (QMP answers in order); events are skipped. A closed socket rejects
 * the command in flight and every later one.
 */
export const qmpConnect = (socketPath: string, timeoutMs = 2000): Promise<QmpClient> =>
  new Promise((resolveClient, rejectClient) => {
    const socket = net.connect(socketPath)
    let buffered = ""
    let failure: QmpError | undefined
    let waiting: { resolve: (value: unknown) => void; reject: (error: QmpError) => void } | undefined
    let queue: Promise<unknown> = Promise.resolve()
    const fail = (error: QmpError) => {
      failure ??= error
      const current = waiting
      waiting = undefined
      current?.reject(error)
      socket.destroy()
    }
    const next = (timeout: number): Promise<unknown> =>
      new Promise((resolve, reject) => {
        if (failure !== undefined) return reject(failure)
        const timer = setTimeout(() => fail(new QmpError("no answer in time")), timeout)
        waiting = {
          resolve: (value) => {
            clearTimeout(timer)
            resolve(value)
          },
          reject: (error) => {
            clearTimeout(timer)
            reject(error)
          }
        }
      })
    socket.setEncoding("utf8")
    socket.on("error", (cause) => fail(new QmpError(cause.message, { cause })))
    socket.on("close", () => fail(new QmpError("closed")))
    socket.on("data", (chunk: string) => {
      buffered += chunk
      let newline = buffered.indexOf("\n")
      while (newline !== -1) {
        const line = buffered.slice(0, newline).trim()
        buffered = buffered.slice(newline + 1)
        newline = buffered.indexOf("\n")
        if (line === "") continue
        const message = decodeLine(line)
        if (message === undefined) return fail(new QmpError(`bad line: ${line.slice(0, 200)}`))
        if ("event" in message) continue
        const current = waiting
        waiting = undefined
        if (current === undefined) continue
        if ("error" in message) current.reject(new QmpError(`${message.error.class}: ${message.error.desc}`))
        else current.resolve("return" in message ? message.return : message.QMP)
      }
    })
    const send = (command: string, args: Record<string, unknown> | undefined, timeout: number) => {
      const answer = next(timeout)
      if (failure === undefined)
        socket.write(
          JSON.stringify(args === undefined ? { execute: command } : { execute: command, arguments: args }) +
            "\n"
        )
      return answer
    }
    const client: QmpClient = {
      execute: (command, args, timeout = timeoutMs) => {
        const run = queue.then(
          () => send(command, args, timeout),
          () => send(command, args, timeout)
        )
        queue = run.catch(() => undefined)
        return run
      },
      close: () => {
        failure ??= new QmpError("closed")
        socket.destroy()
      }
    }
    // the greeting, then qmp_capabilities
    next(timeoutMs)
      .then(() => send("qmp_capabilities", undefined, timeoutMs))
      .then(
        () => resolveClient(client),
        (error: unknown) => rejectClient(error)
      )
  })
