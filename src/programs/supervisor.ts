/**
 * The detached supervisor (docs/detached.md): a process that holds a session (lock, VM, broker,
 * Close — the same scoped programs as `open`/`resume`) and serves clients on the session's
 * control socket. It closes on a `stop` request, on its idle timeout (no client and no turn for
 * that long, measured with `Clock`), or when interrupted (SIGTERM in the CLI).
 *
 * Turns run one at a time (the guest runs one at a time); each is a fiber of the supervisor,
 * not of the client that asked for it: a client that goes away without `cancel` leaves its turn
 * running, and watchers (`attach`) see it to its end.
 */
import * as Clock from "effect/Clock"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Option from "effect/Option"
import * as PubSub from "effect/PubSub"
import * as Queue from "effect/Queue"
import type * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as SubscriptionRef from "effect/SubscriptionRef"
import type * as net from "node:net"
import * as path from "node:path"
import {
  LineSocket,
  listenUnix,
  readLine,
  readLines,
  socketBytes,
  writeBytes,
  writeLine
} from "../lib/lineSocket.js"
import { controlSocketPath } from "../lib/socketPath.js"
import {
  CONTROL_VERSION,
  type ControlReply,
  type ControlRequest,
  ControlError,
  decodeRequest,
  encodeReply,
  errorFields,
  MAX_REMOTE_FILE_BYTES,
  REPO_CHUNK,
  type RepoOp,
  type StatusReply,
  type TurnEnded,
  type TurnRequest,
  turnText
} from "../protocol/Control.js"
import type { TtyControl } from "../services/GuestRpc.js"
import * as Repo from "./repo.js"
import { RepoPathInvalid } from "../domain/repoErrors.js"
import type { Session } from "./session.js"

/** why a supervisor closed: asked to, idle, or its guest went away (the VM died) */
export type StopReason = "stop" | "suspend" | "idle" | "guest-gone"

export interface ServeOptions {
  /** close after this long with no client connected and no turn running (default: never) */
  readonly idleTimeout?: Duration.DurationInput | undefined
  /** what the idle timeout does: suspend (default; a stop where the session cannot) or stop */
  readonly idleAction?: "suspend" | "stop" | undefined
  /** told once the control socket listens */
  /** what an attached typist's line is (told in `attached`): "shell" when the session has an agent command */
  readonly lines?: "prompt" | "shell" | undefined
  readonly onReady?:
    ((info: { readonly sessionId: string; readonly socket: string }) => Effect.Effect<void>) | undefined
}

/** what watchers get: each reply with its sequence number (to skip what a replay already sent) */
interface Broadcast {
  readonly seq: number
  readonly reply: ControlReply
  /** the client whose turn it is */
  readonly starter: number | undefined
}

/** the turn running now, with what it printed so far (replayed to a client that attaches) */
interface Running {
  readonly turn: number
  readonly starter: number
  readonly cancel: Deferred.Deferred<void>
  readonly replay: Array<Broadcast>
}
/** replies kept for a late watcher: the turn's start and its latest events */
const REPLAY_CAP = 1024
/** watchers that fall this far behind lose events (never the turn's starter: it gets back pressure) */
const WATCH_BUFFER = 4096

/** where a turn sends its replies besides the watchers: the connection that asked, while it is there */
type Send = (reply: ControlReply) => Effect.Effect<void, ControlError>

/** a tty turn's controls (keys, sizes, signals) held while the turn has not taken them */
const TTY_CONTROLS_QUEUED = 64

/** a typed error to the client (its connection may already be gone) */
const refuse = (send: Send, error: ControlError) =>
  send({ type: "error", error: errorFields(error) }).pipe(
    // a client that reads nothing does not hold the connection open
    Effect.timeout(Duration.seconds(5)),
    Effect.ignore
  )

/**
 * What a client sends after its first request. A line that is not a request (an empty one
 * included) or that is too long ends the stream with a typed error, which the client is told:
 * the connection is then closed, so a flood of junk lines costs one line, not a loop over them.
 */
const requestsAfter = (lines: LineSocket, send: Send): Stream.Stream<ControlRequest, ControlError> =>
  readLines(lines).pipe(
    Stream.mapEffect((line) =>
      Either.match(decodeRequest(line), {
        onLeft: (error) =>
          Effect.fail(
            new ControlError({ reason: "bad request", message: `not a control request: ${error.message}` })
          ),
        onRight: (request) => Effect.succeed(request)
      })
    ),
    Stream.tapError((error) => refuse(send, error))
  )
interface Delivery {
  current: Send | undefined
}

/**
 * Serves `session` on its control socket until stopped (returns the reason) or interrupted.
 * Every connection and turn is tied to the caller's scope: closing it ends them, then the
 * session's own finalizers (Close) run.
 */
const serve = Effect.fn("supervisor.serve")(function* (
  session: Session,
  options: ServeOptions,
  stopWatchers: Array<net.Socket>
) {
  const socketPath = controlSocketPath(session.dir)
  const startedAt = new Date(yield* Clock.currentTimeMillis).toISOString()
  const stopped = yield* Deferred.make<StopReason>()
  const permit = yield* Effect.makeSemaphore(1)
  const hub = yield* Effect.acquireRelease(PubSub.sliding<Broadcast>(WATCH_BUFFER), (hub) =>
    PubSub.shutdown(hub)
  )
  /** connected clients + running turns: the idle clock runs while it is 0 */
  const activity = yield* SubscriptionRef.make(0)
  const idleTimeout = options.idleTimeout === undefined ? undefined : Duration.decode(options.idleTimeout)

  let seq = 0
  let clients = 0
  let nextClient = 1
  let nextTurn = 1
  let typist: number | undefined
  let running: Running | undefined

  const busy = (delta: number) => SubscriptionRef.update(activity, (n) => n + delta)

  const broadcast = (reply: ControlReply) =>
    Effect.suspend(() => {
      const item = { seq: ++seq, reply, starter: running?.starter }
      if (running !== undefined) {
        running.replay.push(item)
        // keep the turn's start and the latest events
        if (running.replay.length > REPLAY_CAP) running.replay.splice(1, 1)
      }
      return PubSub.publish(hub, item)
    })

  const status = (): StatusReply => ({
    type: "status",
    version: CONTROL_VERSION,
    sessionId: session.id,
    pid: process.pid,
    started: startedAt,
    clients,
    turn: running?.turn ?? null,
    hello: session.hello,
    idleTimeoutMs: idleTimeout === undefined ? null : Duration.toMillis(idleTimeout)
  })

  /** one turn, start to end, as a fiber of the supervisor (not of the client that asked) */
  const runTurn = Effect.fn("supervisor.turn")(function* (
    starter: number,
    request: TurnRequest,
    delivery: Delivery,
    cancel: Deferred.Deferred<void>,
    /** a tty turn's typed bytes, resizes and signals (only an exec connection has them) */
    controls?: Stream.Stream<TtyControl>
  ) {
    const emit = (reply: ControlReply) =>
      Effect.zipRight(
        broadcast(reply),
        Effect.suspend(() =>
          delivery.current === undefined
            ? Effect.void
            : delivery.current(reply).pipe(
                // the client went away: the turn goes on without it
                Effect.catchAll(() => Effect.sync(() => (delivery.current = undefined)))
              )
        )
      )
    const text = turnText(request)
    if (typeof text !== "string") {
      const error = new ControlError({ reason: "bad request", message: text.invalid })
      yield* emit({ type: "error", error: errorFields(error) })
      return undefined
    }
    const tty = request.tty
    if (tty !== undefined && controls === undefined) {
      const error = new ControlError({
        reason: "bad request",
        message: "a terminal turn is run by `abox exec -t` (its own connection), not from attach"
      })
      yield* emit({ type: "error", error: errorFields(error) })
      return undefined
    }
    return yield* permit.withPermits(1)(
      Effect.gen(function* () {
        const turn = nextTurn++
        running = { turn, starter, cancel, replay: [] }
        yield* busy(1)
        yield* Effect.addFinalizer(() =>
          Effect.zipRight(
            Effect.sync(() => (running = undefined)),
            busy(-1)
          )
        )
        yield* emit({ type: "turn_started", turn, text: request.text })
        let timedOut = false
        const stopper =
          request.timeoutMs === undefined
            ? Deferred.await(cancel)
            : Effect.race(
                Deferred.await(cancel),
                Effect.sleep(Duration.millis(request.timeoutMs)).pipe(Effect.tap(() => (timedOut = true)))
              )
        const events =
          tty === undefined || controls === undefined
            ? session.turn(text, request.mode, request.limits)
            : session.ttyTurn(text, { ...tty, controls })
        const last = yield* events.pipe(
          Stream.interruptWhen(stopper),
          Stream.runFoldEffect(undefined as TurnEnded | undefined, (end, event) =>
            event._tag === "End"
              ? Effect.succeed<TurnEnded>({
                  type: "turn_end",
                  turn,
                  exitCode: event.exitCode,
                  signal: event.signal,
                  cancelled: event.cancelled,
                  timedOut: false
                })
              : Effect.as(emit({ type: "event", turn, event: event.event }), end)
          ),
          Effect.catchAll((error) =>
            Effect.zipRight(
              emit({ type: "error", error: errorFields(error) }),
              // the VM is gone: nothing more can run; close (Close records how it ended)
              error._tag === "GuestDisconnected" ? Deferred.succeed(stopped, "guest-gone") : Effect.void
            ).pipe(Effect.as("failed" as const))
          )
        )
        if (last === "failed") return undefined
        // interrupted before its end (cancel or timeout): the guest was told to cancel
        const ended: TurnEnded = last ?? {
          type: "turn_end",
          turn,
          exitCode: null,
          signal: null,
          cancelled: true,
          timedOut
        }
        yield* emit(ended)
        return ended
      }).pipe(Effect.scoped)
    )
  })

  /** a `turn` connection (exec): the turn's replies to this client; `cancel` lines cancel it */
  const exec = (client: number, request: TurnRequest, lines: LineSocket, send: Send) =>
    Effect.gen(function* () {
      const delivery: Delivery = { current: send }
      const cancel = yield* Deferred.make<void>()
      // a tty turn's keys, sizes and signals: only from this connection, the one that started it.
      // Bounded: a client typing faster than the turn takes it waits (its lines stay unread, the
      // socket paused); a turn without a terminal takes none, so they are not kept for it
      const controls = yield* Queue.bounded<TtyControl>(TTY_CONTROLS_QUEUED)
      const tty = request.tty !== undefined
      const fiber = yield* Effect.forkIn(
        runTurn(
          client,
          request,
          delivery,
          cancel,
          request.tty === undefined ? undefined : Stream.fromQueue(controls)
        ),
        serveScope
      )
      const input = requestsAfter(lines, send).pipe(
        Stream.runForEach((next) => {
          switch (next.type) {
            case "cancel":
              return Deferred.succeed(cancel, undefined)
            case "input":
              return tty
                ? Queue.offer(controls, { _tag: "Input", bytes: Buffer.from(next.data, "base64") })
                : Effect.void
            case "resize":
              return tty
                ? Queue.offer(controls, { _tag: "Resize", rows: next.rows, cols: next.cols })
                : Effect.void
            case "signal":
              return tty ? Queue.offer(controls, { _tag: "Signal", signal: next.signal }) : Effect.void
            default:
              return Effect.void
          }
        }),
        Effect.ignore
      )
      // the client's end of the stream: it went away; the turn goes on (docs/detached.md)
      yield* Effect.raceFirst(
        Effect.asVoid(fiber.await),
        Effect.zipRight(
          input,
          Effect.sync(() => (delivery.current = undefined))
        )
      )
    })

  /** an `attach` connection: every turn's replies; the typist's `turn` lines run as turns */
  const attach = (client: number, wantsTypist: boolean, lines: LineSocket, send: Send) =>
    Effect.gen(function* () {
      const isTypist = wantsTypist && typist === undefined
      if (isTypist) {
        typist = client
        yield* Effect.addFinalizer(() => Effect.sync(() => (typist = typist === client ? undefined : typist)))
      }
      const subscription = yield* PubSub.subscribe(hub)
      yield* send({ type: "attached", typist: isTypist, lines: options.lines ?? "prompt" })
      // a turn's start tells its typist that it is theirs
      const deliver = (item: Broadcast) =>
        send(
          item.reply.type === "turn_started" && item.starter === client
            ? { ...item.reply, mine: true }
            : item.reply
        )
      const replay = running?.replay.slice() ?? []
      for (const item of replay) yield* deliver(item)
      const seen = replay.at(-1)?.seq ?? 0
      const watch = Stream.fromQueue(subscription).pipe(
        Stream.filter((item) => item.seq > seen),
        Stream.runForEach(deliver)
      )
      const input = requestsAfter(lines, send).pipe(
        Stream.runForEach((request) => typed(client, isTypist, request, send))
      )
      yield* Effect.raceFirst(watch, input).pipe(Effect.ignore)
    })

  /**
   * a `forward` connection: after `forward_ok` its bytes go to 127.0.0.1:<port> in the guest
   * over a protocol channel, and back; each direction's end is passed on as an EOF
   */
  const forward = (port: number, lines: LineSocket, send: Send) =>
    Effect.gen(function* () {
      const channel = yield* session.connection
        .forward(port)
        .pipe(
          Effect.tapError((error) => send({ type: "error", error: errorFields(error) }).pipe(Effect.ignore))
        )
      yield* send({ type: "forward_ok", port })
      const socket = lines.socket
      const rest = lines.takeRaw()
      const up = Effect.gen(function* () {
        if (rest.length > 0) yield* channel.write(rest)
        yield* Stream.runForEach(socketBytes(socket), (chunk) => channel.write(chunk))
        yield* channel.end
      })
      const down = Stream.runForEach(channel.read, (chunk) => writeBytes(socket, chunk)).pipe(
        Effect.zipRight(Effect.sync(() => socket.end()))
      )
      yield* Effect.all([up, down], { concurrency: 2, discard: true })
    })

  /**
   * a `repo` connection: the repository operation on this session's connection, as on a stopped
   * session (src/programs/repo.ts: the archive checks and the staging happen here, in this
   * process, before anything lands at the client's host path); a diff comes back in pieces
   */
  const repo = (request: RepoOp, send: Send) =>
    Effect.gen(function* () {
      const connection = session.connection
      const hostPaths =
        request.op === "apply"
          ? [request.to]
          : request.op === "copy_out" || request.op === "copy_in"
            ? [request.hostPath]
            : []
      const relative = hostPaths.find((p) => !path.isAbsolute(p))
      if (relative !== undefined)
        return yield* new ControlError({
          reason: "bad request",
          message: `not an absolute host path: ${relative}`
        })
      switch (request.op) {
        case "diff": {
          const patch = yield* Repo.diff(connection, { stat: request.stat, paths: request.paths })
          for (let at = 0; at < patch.length; at += REPO_CHUNK)
            yield* send({ type: "repo_data", data: patch.slice(at, at + REPO_CHUNK) })
          return yield* send({ type: "repo_done" })
        }
        case "apply": {
          const touched = yield* Repo.apply(connection, {
            to: request.to,
            check: request.check,
            threeWay: request.threeWay,
            paths: request.paths
          })
          return yield* send({ type: "repo_done", paths: [...touched] })
        }
        case "copy_out": {
          const result = yield* Repo.copyOut(connection, request.guestPath, request.hostPath, {
            includeGit: request.includeGit
          })
          return yield* send({
            type: "repo_done",
            files: result.files,
            bytes: result.bytes,
            path: result.path
          })
        }
        case "copy_in": {
          const result = yield* Repo.copyIn(connection, request.hostPath, request.guestDir)
          return yield* send({ type: "repo_done", files: result.files, bytes: result.bytes })
        }
        case "read": {
          const bytes = yield* Repo.readFile(connection, request.path)
          if (bytes.length > MAX_REMOTE_FILE_BYTES)
            return yield* new RepoPathInvalid({
              path: request.path,
              message: `${request.path} is larger than ${MAX_REMOTE_FILE_BYTES} bytes: use cp (files.copyOut)`
            })
          const text = Buffer.from(bytes).toString("base64")
          for (let at = 0; at < text.length; at += REPO_CHUNK)
            yield* send({ type: "repo_data", data: text.slice(at, at + REPO_CHUNK) })
          return yield* send({ type: "repo_done", bytes: bytes.length })
        }
        case "write": {
          const bytes = Buffer.from(request.data, "base64")
          yield* Repo.writeFile(connection, request.path, new Uint8Array(bytes), request.mode)
          return yield* send({ type: "repo_done", bytes: bytes.length })
        }
        case "list": {
          const entries = yield* Repo.listFiles(connection, request.path)
          return yield* send({ type: "repo_done", entries: [...entries] })
        }
      }
    }).pipe(
      Effect.catchAll((error) =>
        error._tag === "ControlError" && error.reason !== "bad request"
          ? Effect.fail(error)
          : send({ type: "error", error: errorFields(error) })
      )
    )

  /** what an attached client may send after `attach` */
  const typed = (client: number, isTypist: boolean, request: ControlRequest, send: Send) => {
    if (request.type === "cancel") {
      const current = running
      return current !== undefined && current.starter === client
        ? Deferred.succeed(current.cancel, undefined)
        : Effect.void
    }
    if (request.type !== "turn") return Effect.void
    if (!isTypist) {
      const error = new ControlError({
        reason: "not typist",
        message: "another client types in this session; this one watches"
      })
      return send({ type: "error", error: errorFields(error) })
    }
    return Deferred.make<void>().pipe(
      Effect.flatMap((cancel) =>
        Effect.forkIn(runTurn(client, request, { current: undefined }, cancel), serveScope)
      ),
      Effect.asVoid
    )
  }

  /** the client's end of a connection that sends nothing after its request (EOF: it is gone) */
  const untilClosed = (lines: LineSocket) => Stream.runDrain(readLines(lines)).pipe(Effect.ignore)

  const handle = (socket: net.Socket) =>
    Effect.gen(function* () {
      const client = nextClient++
      const lines = new LineSocket(socket)
      let keep = false
      yield* Effect.addFinalizer(() => Effect.sync(() => (keep ? undefined : socket.destroy())))
      clients++
      yield* busy(1)
      yield* Effect.addFinalizer(() =>
        Effect.zipRight(
          Effect.sync(() => clients--),
          busy(-1)
        )
      )
      const send = (reply: ControlReply) => writeLine(socket, encodeReply(reply))
      const first = yield* readLine(lines).pipe(Effect.tapError((error) => refuse(send, error)))
      if (Option.isNone(first)) return
      const decoded = decodeRequest(first.value)
      if (Either.isLeft(decoded))
        return yield* refuse(
          send,
          new ControlError({
            reason: "bad request",
            message: `not a control request: ${decoded.left.message}`
          })
        )
      const request = decoded.right
      switch (request.type) {
        case "status":
          return yield* send(status())
        case "stop": {
          // suspend first when asked: refused (a turn runs, an old guest), the session runs on
          if (request.suspend === true) {
            const saved = yield* Effect.either(session.suspend)
            if (Either.isLeft(saved)) return yield* send({ type: "error", error: errorFields(saved.left) })
          }
          // this client hears the end: its connection stays open until this process exits
          keep = true
          stopWatchers.push(socket)
          socket.unref()
          yield* send({ type: "stopping", pid: process.pid })
          yield* Deferred.succeed(stopped, request.suspend === true ? "suspend" : "stop")
          return
        }
        case "turn":
          return yield* exec(client, request, lines, send)
        case "attach":
          return yield* attach(client, request.typist, lines, send)
        case "forward":
          return yield* forward(request.port, lines, send)
        case "repo":
          // the client gone (its connection closed): the operation is interrupted, which stops
          // the guest's export (src/lib/hostExtract.ts) instead of reading it to its end
          return yield* Effect.raceFirst(repo(request.request, send), untilClosed(lines))
        case "cancel": {
          const error = new ControlError({
            reason: "bad request",
            message: "cancel: no turn on this connection"
          })
          return yield* send({ type: "error", error: errorFields(error) })
        }
      }
    }).pipe(
      Effect.scoped,
      Effect.catchAll((error) => Effect.logDebug("control connection", error.message))
    )

  const serveScope: Scope.Scope = yield* Effect.scope

  const connections = yield* listenUnix(socketPath)
  yield* Queue.take(connections).pipe(
    Effect.flatMap((socket) => Effect.forkIn(handle(socket), serveScope)),
    Effect.forever,
    Effect.forkScoped
  )

  if (idleTimeout !== undefined) {
    yield* activity.changes.pipe(
      Stream.map((n) => n === 0),
      Stream.changes,
      Stream.flatMap((idle) => (idle ? Stream.fromEffect(Effect.sleep(idleTimeout)) : Stream.empty), {
        switch: true
      }),
      Stream.runForEach(() =>
        (options.idleAction === "stop"
          ? Effect.void
          : session.suspend.pipe(
              Effect.tapError((error) =>
                Effect.logWarning(`idle: not suspended, stopping: ${error.message}`)
              ),
              Effect.ignore
            )
        ).pipe(Effect.zipRight(Deferred.succeed(stopped, "idle")))
      ),
      Effect.forkScoped
    )
  }

  if (options.onReady !== undefined) yield* options.onReady({ sessionId: session.id, socket: socketPath })
  return yield* Deferred.await(stopped)
})

/**
 * A session under a supervisor: `acquire` (Open or Resume) in a scope of its own, served until
 * stopped, then closed (the session's finalizers). A client that asked to `stop` has its
 * connection ended only after Close, so it hears when the session is really down.
 */
export const supervise = <E, R>(acquire: Effect.Effect<Session, E, R>, options: ServeOptions = {}) =>
  Effect.gen(function* () {
    const stopWatchers: Array<net.Socket> = []
    return yield* Effect.scoped(
      Effect.flatMap(acquire, (session) => serve(session, options, stopWatchers))
    ).pipe(Effect.ensuring(Effect.sync(() => stopWatchers.forEach((socket) => socket.destroy()))))
  })
