/**
 * The detached supervisor (docs/detached.md): a process that holds a session (lock, VM, broker,
 * Close — the same scoped programs as `open`/`resume`) and serves the control plane
 * (`ControlRpcs`, src/services/ControlRpc.ts) on the session's control socket. It closes on a
 * `Stop` request, on its idle timeout (no client and no turn for that long: programs/idle.ts),
 * or when interrupted (SIGTERM in the CLI).
 *
 * Its parts: the socket's handshake (version, then RPC or a raw port forward), the session
 * host's state (the turn slot behind a Semaphore, the running turn with its replay buffer, the
 * typist, a PubSub of what watchers see), and the RPC handlers, small functions over that state.
 *
 * Turns run one at a time (the guest runs one at a time); each is a fiber of the supervisor,
 * not of the client that asked for it: a client that goes away without `Cancel` leaves its turn
 * running, and watchers (`Attach`) see it to its end.
 */
import * as CommandExecutor from "@effect/platform/CommandExecutor"
import * as RpcServer from "@effect/rpc/RpcServer"
import * as Clock from "effect/Clock"
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Exit from "effect/Exit"
import * as Option from "effect/Option"
import * as PubSub from "effect/PubSub"
import * as Queue from "effect/Queue"
import * as Ref from "effect/Ref"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import type * as net from "node:net"
import type { Duplex } from "node:stream"
import {
  duplexAfter,
  LineSocket,
  listenUnix,
  readLine,
  socketBytes,
  writeBytes,
  writeLine
} from "../lib/lineSocket.js"
import { controlSocketPath } from "../lib/socketPath.js"
import {
  CONTROL_VERSION,
  ControlError,
  ControlVersionMismatch,
  decodeHello,
  encodeWelcome,
  errorFields,
  MAX_REMOTE_FILE_BYTES,
  REPO_CHUNK,
  type TurnRequest,
  turnText
} from "../protocol/Control.js"
import { type AttachOutput, ControlRpcs, type TurnEnded, type TurnOutput } from "../services/ControlRpc.js"
import type { TtyControl } from "../services/GuestRpc.js"
import { RepoPathInvalid } from "../domain/repoErrors.js"
import { idleTimeout } from "./idle.js"
import { makeControlProtocol } from "./controlProtocol.js"
import * as Repo from "./repo.js"
import type { Session } from "./session.js"

/** why a supervisor closed: asked to, idle, or its guest went away (the VM died) */
export type StopReason = "stop" | "suspend" | "idle" | "guest-gone"

export interface ServeOptions {
  /** close after this long with no client connected and no turn running (default: never) */
  readonly idleTimeout?: Duration.DurationInput | undefined
  /** what the idle timeout does: suspend (default; a stop where the session cannot) or stop */
  readonly idleAction?: "suspend" | "stop" | undefined
  /** what an attached typist's line is (told in `Attached`): "shell" when the session has an agent command */
  readonly lines?: "prompt" | "shell" | undefined
  /** told once the control socket listens */
  readonly onReady?:
    ((info: { readonly sessionId: string; readonly socket: string }) => Effect.Effect<void>) | undefined
}

/** what watchers get: each element with its sequence number (to skip what a replay already sent) */
interface Broadcast {
  readonly seq: number
  readonly item: AttachOutput
  /** the client whose turn it is */
  readonly starter: number | undefined
}

/** the turn running now, with what it printed so far (replayed to a client that attaches) */
interface Running {
  readonly turn: number
  readonly starter: number
  readonly replay: Array<Broadcast>
}
/** elements kept for a late watcher: the turn's start and its latest events */
const REPLAY_CAP = 1024
/** watchers that fall this far behind lose events (never the turn's starter: it gets back pressure) */
const WATCH_BUFFER = 4096
/** a turn's elements held for its starter while it reads them (then the turn waits) */
const STARTER_BUFFER = 64
/** a tty turn's controls (keys, sizes, signals) held while the turn has not taken them */
const TTY_CONTROLS_QUEUED = 64
/** how long a new connection may take to send its handshake line */
const HANDSHAKE_TIMEOUT = Duration.seconds(10)

/** what a turn's starter is told: its elements, or the error that ended it */
type ToStarter = TurnOutput | { readonly _tag: "Error"; readonly error: TurnFailure }
type TurnFailure = Stream.Stream.Error<ReturnType<Session["ttyTurn"]>> | ControlError

/** a client's own turns: how to cancel them, and a tty turn's controls */
interface ClientTurns {
  readonly cancels: Set<Deferred.Deferred<void>>
  controls: { readonly queue: Queue.Queue<TtyControl>; readonly done: Deferred.Deferred<void> } | undefined
}

/**
 * The session host's state and the turn runner: one turn at a time (the permit), the running
 * turn and its replay, the typist, the hub every watcher reads, and each client's own turns.
 */
const makeHost = Effect.fn("supervisor.host")(function* (
  session: Session,
  stopped: Deferred.Deferred<StopReason>,
  onTurn: { readonly begin: Effect.Effect<void>; readonly end: Effect.Effect<void> }
) {
  const scope = yield* Effect.scope
  const permit = yield* Effect.makeSemaphore(1)
  const hub = yield* Effect.acquireRelease(PubSub.sliding<Broadcast>(WATCH_BUFFER), (hub) =>
    PubSub.shutdown(hub)
  )
  const seq = yield* Ref.make(0)
  const nextTurn = yield* Ref.make(1)
  const running = yield* Ref.make<Running | undefined>(undefined)
  const typist = yield* Ref.make<number | undefined>(undefined)
  const clients = new Map<number, ClientTurns>()
  const turnsOf = (client: number): ClientTurns => {
    let turns = clients.get(client)
    if (turns === undefined) {
      turns = { cancels: new Set(), controls: undefined }
      clients.set(client, turns)
    }
    return turns
  }

  const broadcast = (item: AttachOutput) =>
    Effect.gen(function* () {
      const current = yield* Ref.get(running)
      const entry = { seq: yield* Ref.updateAndGet(seq, (n) => n + 1), item, starter: current?.starter }
      if (current !== undefined) {
        current.replay.push(entry)
        // keep the turn's start and the latest events
        if (current.replay.length > REPLAY_CAP) current.replay.splice(1, 1)
      }
      yield* PubSub.publish(hub, entry)
    })

  /**
   * one turn, start to end, as a fiber of the supervisor (not of the client that asked);
   * `deliver` is its starter's, for as long as it is there
   */
  const runTurn = Effect.fn("supervisor.turn")(function* (
    starter: number,
    request: TurnRequest,
    deliver: (item: ToStarter) => Effect.Effect<void>,
    cancel: Deferred.Deferred<void>,
    /** a tty turn's typed bytes, resizes and signals (only a `Turn` caller has them) */
    controls?: Stream.Stream<TtyControl>
  ) {
    const fail = (turn: number | null, error: TurnFailure) =>
      Effect.zipRight(
        broadcast({ _tag: "Failed", turn, error: errorFields(error) }),
        deliver({ _tag: "Error", error })
      )
    const emit = (item: TurnOutput) => Effect.zipRight(broadcast(item), deliver(item))
    const text = turnText(request)
    if (typeof text !== "string")
      return yield* fail(null, new ControlError({ reason: "bad request", message: text.invalid }))
    const tty = request.tty
    if (tty !== undefined && controls === undefined)
      return yield* fail(
        null,
        new ControlError({
          reason: "bad request",
          message: "a terminal turn is run by `abox exec -t` (its own connection), not from attach"
        })
      )
    yield* permit.withPermits(1)(
      Effect.gen(function* () {
        const turn = yield* Ref.getAndUpdate(nextTurn, (n) => n + 1)
        yield* Ref.set(running, { turn, starter, replay: [] })
        yield* onTurn.begin
        yield* Effect.addFinalizer(() => Effect.zipRight(Ref.set(running, undefined), onTurn.end))
        yield* emit({ _tag: "Started", turn, text: request.text })
        const timedOut = yield* Ref.make(false)
        const stopper =
          request.timeoutMs === undefined
            ? Deferred.await(cancel)
            : Effect.race(
                Deferred.await(cancel),
                Effect.sleep(Duration.millis(request.timeoutMs)).pipe(
                  Effect.zipRight(Ref.set(timedOut, true))
                )
              )
        const events =
          tty === undefined || controls === undefined
            ? session.turn(text, request.mode, request.limits)
            : session.ttyTurn(text, { ...tty, controls })
        const last = yield* events.pipe(
          Stream.interruptWhen(stopper),
          Stream.runFoldEffect(Option.none<TurnEnded>(), (end, event) =>
            event._tag === "End"
              ? Effect.succeed(
                  Option.some<TurnEnded>({
                    _tag: "Ended",
                    turn,
                    exitCode: event.exitCode,
                    signal: event.signal,
                    cancelled: event.cancelled,
                    timedOut: false
                  })
                )
              : Effect.as(emit({ _tag: "Event", turn, event: event.event }), end)
          ),
          Effect.either
        )
        if (Either.isLeft(last)) {
          yield* fail(turn, last.left)
          // the VM is gone: nothing more can run; close (Close records how it ended)
          if (last.left._tag === "GuestDisconnected") yield* Deferred.succeed(stopped, "guest-gone")
          return
        }
        // interrupted before its end (cancel or timeout): the guest was told to cancel
        const ended = Option.getOrElse(last.right, (): TurnEnded => ({
          _tag: "Ended",
          turn,
          exitCode: null,
          signal: null,
          cancelled: true,
          timedOut: false
        }))
        yield* emit(Option.isNone(last.right) ? { ...ended, timedOut: yield* Ref.get(timedOut) } : ended)
      }).pipe(Effect.scoped)
    )
  })

  /** `runTurn` forked in the host's scope (it outlives the request that started it) */
  const startTurn = (
    client: number,
    request: TurnRequest,
    deliver: (item: ToStarter) => Effect.Effect<void>,
    controls?: Stream.Stream<TtyControl>
  ) =>
    Effect.gen(function* () {
      const cancel = yield* Deferred.make<void>()
      const own = turnsOf(client)
      own.cancels.add(cancel)
      return yield* Effect.forkIn(
        runTurn(client, request, deliver, cancel, controls).pipe(
          Effect.ensuring(Effect.sync(() => own.cancels.delete(cancel)))
        ),
        scope
      )
    })

  return {
    hub,
    running,
    typist,
    turnsOf,
    startTurn,
    /** a client went away: what it held is let go (its turns go on) */
    forget: (client: number) =>
      Effect.zipRight(
        Effect.sync(() => clients.delete(client)),
        Ref.update(typist, (t) => (t === client ? undefined : t))
      )
  }
})
type Host = Effect.Effect.Success<ReturnType<typeof makeHost>>

/** the RPC handlers: each a small function over the host's state */
const handlers = (
  session: Session,
  host: Host,
  options: ServeOptions,
  info: {
    readonly startedAt: string
    readonly clients: Ref.Ref<number>
    readonly stopped: Deferred.Deferred<StopReason>
    readonly executor: CommandExecutor.CommandExecutor
  }
) => {
  const idleTimeoutMs = options.idleTimeout === undefined ? null : Duration.toMillis(options.idleTimeout)
  const connection = session.connection
  return ControlRpcs.of({
    Status: () =>
      Effect.gen(function* () {
        return {
          version: CONTROL_VERSION,
          sessionId: session.id,
          pid: process.pid,
          started: info.startedAt,
          clients: yield* Ref.get(info.clients),
          turn: (yield* Ref.get(host.running))?.turn ?? null,
          hello: session.hello,
          idleTimeoutMs
        }
      }),
    // the caller hears the end: its connection stays open until this process exits (after Close)
    // with suspend, the memory is saved first: refused (a turn runs, an old guest), the session runs on
    Stop: ({ suspend }) =>
      Stream.unwrap(
        Effect.as(
          suspend === true ? session.suspend : Effect.void,
          Stream.concat(
            Stream.make({ _tag: "Stopping" as const, pid: process.pid }),
            Stream.fromEffect(Deferred.succeed(info.stopped, suspend === true ? "suspend" : "stop")).pipe(
              Stream.zipRight(Stream.never)
            )
          )
        )
      ),
    // the fork's first half (src/programs/fork.ts): refused while a turn runs, or by an old guest
    Fork: ({ statePath }) =>
      Effect.gen(function* () {
        const frozen = yield* session.freeze(statePath)
        const { root, repo } = frozen.frozen
        if (root === undefined)
          return yield* new ControlError({
            reason: "fork",
            message: "this session's root disk is not a qcow2 overlay"
          })
        return { root, ...(repo === undefined ? {} : { repo }), manifest: frozen.manifest }
      }).pipe(Effect.provideService(CommandExecutor.CommandExecutor, info.executor)),
    Turn: (request, { clientId }) =>
      Stream.unwrapScoped(
        Effect.gen(function* () {
          // the turn's elements for this caller; the turn waits while it reads (back pressure),
          // and goes on without it once it is gone
          const out = yield* Queue.bounded<ToStarter>(STARTER_BUFFER)
          const gone = yield* Deferred.make<void>()
          yield* Effect.addFinalizer(() => Deferred.succeed(gone, undefined))
          const deliver = (item: ToStarter) =>
            Effect.raceFirst(Queue.offer(out, item), Deferred.await(gone)).pipe(Effect.asVoid)
          let controls: Stream.Stream<TtyControl> | undefined
          if (request.tty !== undefined) {
            // a tty turn's keys, sizes and signals: only from this caller's connection. Bounded:
            // a client typing faster than the turn takes it waits for its `Input` to return
            const queue = yield* Queue.bounded<TtyControl>(TTY_CONTROLS_QUEUED)
            const done = yield* Deferred.make<void>()
            const own = host.turnsOf(clientId)
            own.controls = { queue, done }
            yield* Effect.addFinalizer(() =>
              Effect.zipRight(
                Deferred.succeed(done, undefined),
                Effect.sync(() => (own.controls?.queue === queue ? (own.controls = undefined) : undefined))
              )
            )
            controls = Stream.fromQueue(queue)
          }
          yield* host.startTurn(clientId, request, deliver, controls)
          return Stream.fromQueue(out).pipe(
            Stream.takeUntil((item) => item._tag === "Ended" || item._tag === "Error"),
            Stream.mapEffect((item) =>
              item._tag === "Error" ? Effect.fail(item.error) : Effect.succeed(item)
            )
          )
        })
      ),
    Cancel: (_, { clientId }) =>
      Effect.forEach(host.turnsOf(clientId).cancels, (cancel) => Deferred.succeed(cancel, undefined), {
        discard: true
      }),
    Input: ({ data }, { clientId }) => control(clientId, { _tag: "Input", bytes: data }),
    Resize: ({ rows, cols }, { clientId }) => control(clientId, { _tag: "Resize", rows, cols }),
    Signal: ({ signal }, { clientId }) => control(clientId, { _tag: "Signal", signal }),
    Attach: ({ typist: wantsTypist }, { clientId }) =>
      Stream.unwrapScoped(
        Effect.gen(function* () {
          const isTypist =
            wantsTypist &&
            (yield* Ref.modify(host.typist, (t) => (t === undefined ? [true, clientId] : [false, t])))
          if (isTypist)
            yield* Effect.addFinalizer(() => Ref.update(host.typist, (t) => (t === clientId ? undefined : t)))
          const subscription = yield* PubSub.subscribe(host.hub)
          // a turn's start tells its typist that it is theirs
          const mine = (entry: Broadcast): AttachOutput =>
            entry.item._tag === "Started" && entry.starter === clientId
              ? { ...entry.item, mine: true }
              : entry.item
          const replay = (yield* Ref.get(host.running))?.replay.slice() ?? []
          const seen = replay.at(-1)?.seq ?? 0
          return Stream.succeed<AttachOutput>({
            _tag: "Attached",
            typist: isTypist,
            lines: options.lines ?? "prompt"
          }).pipe(
            Stream.concat(Stream.fromIterable(replay.map(mine))),
            Stream.concat(
              Stream.fromQueue(subscription).pipe(
                Stream.filter((entry) => entry.seq > seen),
                Stream.map(mine)
              )
            )
          )
        })
      ),
    Type: (request, { clientId }) =>
      Effect.gen(function* () {
        if ((yield* Ref.get(host.typist)) !== clientId)
          return yield* new ControlError({
            reason: "not typist",
            message: "another client types in this session; this one watches"
          })
        yield* host.startTurn(clientId, request, () => Effect.void)
      }),
    Diff: (request) =>
      Stream.unwrap(
        Effect.map(Repo.diff(connection, request), (patch) =>
          Stream.fromIterable(
            Array.from({ length: Math.ceil(patch.length / REPO_CHUNK) }, (_, i) =>
              patch.slice(i * REPO_CHUNK, (i + 1) * REPO_CHUNK)
            )
          )
        )
      ),
    Apply: (request) => Repo.apply(connection, request),
    CopyOut: (request) =>
      Repo.copyOut(connection, request.guestPath, request.hostPath, { includeGit: request.includeGit }),
    CopyIn: (request) => Repo.copyIn(connection, request.hostPath, request.guestDir),
    ReadFile: (request) =>
      Effect.flatMap(Repo.readFile(connection, request.path), (bytes) =>
        bytes.length > MAX_REMOTE_FILE_BYTES
          ? new RepoPathInvalid({
              path: request.path,
              message: `${request.path} is larger than ${MAX_REMOTE_FILE_BYTES} bytes: use cp (files.copyOut)`
            })
          : Effect.succeed(bytes)
      ),
    WriteFile: (request) =>
      Effect.as(Repo.writeFile(connection, request.path, request.data, request.mode), request.data.length),
    ListFiles: (request) => Repo.listFiles(connection, request.path)
  })

  /** a tty turn's control from the client that started it; dropped when it runs none */
  function control(client: number, item: TtyControl) {
    return Effect.suspend(() => {
      const controls = host.turnsOf(client).controls
      return controls === undefined
        ? Effect.void
        : Effect.raceFirst(Queue.offer(controls.queue, item), Deferred.await(controls.done)).pipe(
            Effect.asVoid
          )
    })
  }
}

/**
 * a forward connection (after its handshake): its bytes go to 127.0.0.1:<port> in the guest
 * over a protocol channel, and back; each direction's end is passed on as an EOF
 */
const forward = (session: Session, port: number, lines: LineSocket) =>
  Effect.gen(function* () {
    const refusal = yield* session.connection.forward(port).pipe(Effect.either)
    if (Either.isLeft(refusal))
      return yield* writeLine(
        lines.socket,
        encodeWelcome({ type: "refused", version: CONTROL_VERSION, error: errorFields(refusal.left) })
      )
    const channel = refusal.right
    yield* writeLine(lines.socket, encodeWelcome({ type: "welcome", version: CONTROL_VERSION }))
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
 * A connection's handshake: its first line must be a `hello` of this version. Anything else is
 * answered with a typed refusal (ControlVersionMismatch) and the connection closed: a client of
 * another version, which reads that line as its own protocol's error, learns why. Then either a
 * port forward, or the RPC server's connection.
 */
const handshake = (
  session: Session,
  socket: net.Socket,
  rpc: (duplex: Duplex) => Effect.Effect<void, ControlError, Scope.Scope>
) =>
  Effect.gen(function* () {
    const lines = new LineSocket(socket)
    const first = yield* readLine(lines).pipe(
      Effect.timeoutFail({
        duration: HANDSHAKE_TIMEOUT,
        onTimeout: () => new ControlError({ reason: "handshake", message: "no handshake line in time" })
      })
    )
    if (Option.isNone(first)) return
    const hello = decodeHello(first.value)
    if (Either.isLeft(hello) || hello.right.version !== CONTROL_VERSION) {
      const peer = Either.isRight(hello) ? hello.right.version : null
      const error = new ControlVersionMismatch({
        version: CONTROL_VERSION,
        peer,
        message:
          peer === null
            ? `not a control protocol v${CONTROL_VERSION} handshake: this session's supervisor is newer than this client (restart the client's abox, or stop and start the session)`
            : `control protocol v${peer} spoken to a supervisor of v${CONTROL_VERSION}: use the same abox for both (stop and start the session)`
      })
      // both shapes: this version's refusal, and the line a v1 client reads as a typed error
      const refusal =
        peer === null
          ? JSON.stringify({ type: "error", error: errorFields(error) })
          : encodeWelcome({ type: "refused", version: CONTROL_VERSION, error: errorFields(error) })
      return yield* writeLine(socket, refusal).pipe(Effect.timeout(Duration.seconds(5)), Effect.ignore)
    }
    if (hello.right.forward !== undefined) return yield* forward(session, hello.right.forward, lines)
    yield* writeLine(socket, encodeWelcome({ type: "welcome", version: CONTROL_VERSION }))
    const duplex = duplexAfter(lines)
    yield* Effect.addFinalizer(() => Effect.sync(() => duplex.destroy()))
    yield* rpc(duplex)
  })

/**
 * What the idle timeout does: suspend the session (the default; a stop where it cannot, said in
 * the log) or stop it. Not interrupted by a client that connects meanwhile: the save runs to its end.
 */
const onIdle = (session: Session, options: ServeOptions, stopped: Deferred.Deferred<StopReason>) =>
  (options.idleAction === "stop"
    ? Effect.void
    : session.suspend.pipe(
        Effect.tapError((error) => Effect.logWarning(`idle: not suspended, stopping: ${error.message}`)),
        Effect.ignore
      )
  ).pipe(Effect.zipRight(Deferred.succeed(stopped, "idle")), Effect.asVoid, Effect.uninterruptible)

/**
 * Serves `session` on its control socket until stopped (returns the reason) or interrupted.
 * Turns are tied to the caller's scope (closing it ends them, then the session's own finalizers,
 * Close, run); connections and the RPC server to `outer`, which closes after Close, so a client
 * that asked to stop hears when the session is really down.
 */
const serve = Effect.fn("supervisor.serve")(function* (
  session: Session,
  options: ServeOptions,
  outer: Scope.Scope
) {
  const socketPath = controlSocketPath(session.dir)
  const startedAt = new Date(yield* Clock.currentTimeMillis).toISOString()
  const stopped = yield* Deferred.make<StopReason>()
  const clients = yield* Ref.make(0)
  // activity, for the idle timeout: connected clients and running turns
  const idle =
    options.idleTimeout === undefined
      ? { begin: Effect.void, end: Effect.void, touch: Effect.void }
      : yield* idleTimeout(options.idleTimeout, onIdle(session, options, stopped))
  const host = yield* makeHost(session, stopped, idle)
  // a VM that ends by itself (killed, crashed) ends its host: a supervisor never outlives its VM
  yield* Effect.forkScoped(session.vmEnded.pipe(Effect.zipRight(Deferred.succeed(stopped, "guest-gone"))))

  // the RPC server, fed the connections that passed their handshake (programs/controlProtocol.ts)
  const control = yield* makeControlProtocol
  const context = yield* ControlRpcs.toHandlersContext(
    Effect.succeed(
      handlers(session, host, options, {
        startedAt,
        clients,
        stopped,
        executor: yield* CommandExecutor.CommandExecutor
      })
    )
  )
  // no span per request: a flood of small requests would make one each
  yield* RpcServer.make(ControlRpcs, { disableTracing: true }).pipe(
    Effect.provide(context),
    Effect.provideService(RpcServer.Protocol, control.protocol),
    Effect.interruptible,
    Effect.forkIn(outer)
  )

  const connection = (socket: net.Socket, id: number) =>
    Effect.gen(function* () {
      yield* Effect.addFinalizer(() => Effect.sync(() => socket.destroy()))
      yield* Ref.update(clients, (n) => n + 1)
      yield* idle.begin
      yield* Effect.addFinalizer(() =>
        Effect.zipRight(
          Ref.update(clients, (n) => n - 1),
          idle.end
        )
      )
      yield* handshake(session, socket, control.serve)
    }).pipe(
      Effect.scoped,
      Effect.catchAll((error) => Effect.logDebug("control connection", id, error.message))
    )

  const connections = yield* Scope.extend(listenUnix(socketPath), outer)
  let nextConnection = 1
  // accepting ends with the session (this scope); connections end with `outer`
  yield* Queue.take(connections).pipe(
    Effect.flatMap((socket) => Effect.forkIn(connection(socket, nextConnection++), outer)),
    Effect.forever,
    Effect.forkScoped
  )

  if (options.onReady !== undefined) yield* options.onReady({ sessionId: session.id, socket: socketPath })
  return yield* Deferred.await(stopped)
})

/**
 * A session under a supervisor: `acquire` (Open or Resume) in a scope of its own, served until
 * stopped, then closed (the session's finalizers). A client that asked to `Stop` has its
 * connection ended only after Close, so it hears when the session is really down.
 */
export const supervise = <E, R>(acquire: Effect.Effect<Session, E, R>, options: ServeOptions = {}) =>
  Effect.acquireUseRelease(
    Scope.make(),
    (outer) => Effect.scoped(Effect.flatMap(acquire, (session) => serve(session, options, outer))),
    (outer, exit) => Scope.close(outer, Exit.isSuccess(exit) ? Exit.void : exit)
  )
