/**
 * Clients of a detached session (docs/detached.md): start a supervisor in the background, and
 * talk to a running one over its control socket (`ControlRpcs` through an `RpcClient`; a port
 * forward as raw bytes). The CLI and the SDK share these; `remoteSession` is the Session
 * contract (src/services/Session.ts) over them.
 */
import * as NodeSocket from "@effect/platform-node/NodeSocket"
import * as Socket from "@effect/platform/Socket"
import type * as CommandExecutor from "@effect/platform/CommandExecutor"
import * as RpcClient from "@effect/rpc/RpcClient"
import type { RpcClientError } from "@effect/rpc/RpcClientError"
import * as RpcSerialization from "@effect/rpc/RpcSerialization"
import * as Config from "effect/Config"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Option from "effect/Option"
import * as Queue from "effect/Queue"
import * as Schedule from "effect/Schedule"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import type * as net from "node:net"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import {
  connectUnix,
  duplexAfter,
  LineSocket,
  listenLoopback,
  readLine,
  splice,
  writeLine
} from "../lib/lineSocket.js"
import { controlSocketPath } from "../lib/socketPath.js"
import type { TurnLimits } from "../protocol/Messages.js"
import {
  CONTROL_VERSION,
  ControlError,
  ControlRefused,
  ControlVersionMismatch,
  decodeReadyLine,
  decodeWelcome,
  encodeHello,
  type ErrorFields,
  MAX_REMOTE_PATCH,
  SessionNotRunning,
  type TurnRequest
} from "../protocol/Control.js"
import { ControlRpcs, controlSerialization, type StatusInfo } from "../services/ControlRpc.js"
import { BrokerError, BrokerPolicyError } from "../services/HttpsBroker.js"
import { DiskError, ImageNotFound } from "../domain/image.js"
import { SourceInvalid, TransferFailed } from "../domain/transfer.js"
import { LockError, SessionBusy } from "../services/RuntimeLock.js"
import {
  InvalidName,
  NameTaken,
  SessionCorrupt,
  SessionFormatTooNew,
  SessionNotFound,
  StoreIoError
} from "../services/SessionStore.js"
import { VmmError, VmmUnavailable } from "../domain/vm.js"
import { GuestTimeout, GuestTooNew, GuestTooOld, ProtocolError } from "../services/GuestRpc.js"
import { SessionIncompatible } from "./compat.js"
import { AboxPaths } from "../services/AboxPaths.js"
import { agentTurnEvent, ForwardRefused, GuestDisconnected, type TurnEvent } from "../services/GuestRpc.js"
import { SessionStore } from "../services/SessionStore.js"
import type { SessionContract, SessionRepo } from "../services/Session.js"
import * as Repo from "./repo.js"

// ---- errors across the process boundary ----

/** what starting a supervisor (Open or Resume in it) may fail with, told on its ready pipe */
export const StartError = Schema.Union(
  SessionNotFound,
  SessionCorrupt,
  SessionFormatTooNew,
  StoreIoError,
  NameTaken,
  InvalidName,
  SessionBusy,
  LockError,
  SessionIncompatible,
  SourceInvalid,
  VmmError,
  VmmUnavailable,
  GuestTooOld,
  GuestTooNew,
  ProtocolError,
  GuestTimeout,
  GuestDisconnected,
  TransferFailed,
  ImageNotFound,
  DiskError,
  BrokerPolicyError,
  BrokerError,
  ControlError
)
export type StartError = typeof StartError.Type
const decodeStartError = Schema.decodeUnknownEither(StartError)
/** an error a supervisor sent on its ready pipe, as its own class when known (so it maps to its exit code) */
export const remoteError = (fields: ErrorFields): StartError | ControlRefused =>
  Either.getOrElse(
    decodeStartError(fields),
    () => new ControlRefused({ tag: fields._tag, message: fields.message })
  )

/** what a supervisor may refuse a connection with: another version, a port forward the guest refused */
const Refusal = Schema.Union(ControlVersionMismatch, ForwardRefused, GuestDisconnected)
const decodeRefusal = Schema.decodeUnknownEither(Refusal)
const refusalOf = (fields: ErrorFields) =>
  Either.getOrElse(
    decodeRefusal(fields),
    () => new ControlRefused({ tag: fields._tag, message: fields.message })
  )

// ---- spawning a supervisor ----

/** what the supervisor process does: Open a directory or Resume a session, then serve */
export const SuperviseSpec = Schema.Struct({
  open: Schema.optional(
    Schema.Struct({
      source: Schema.String,
      name: Schema.optional(Schema.String),
      image: Schema.optional(Schema.String),
      /** `--allow-env-hosts`: grant the hosts the repository's environment asks for */
      allowEnvHosts: Schema.optional(Schema.Boolean)
    })
  ),
  resume: Schema.optional(Schema.String),
  model: Schema.optional(Schema.String),
  cpus: Schema.optional(Schema.Int),
  memoryMiB: Schema.optional(Schema.Int),
  agent: Schema.optional(Schema.Array(Schema.String)),
  policyFile: Schema.optional(Schema.String),
  idleTimeoutMs: Schema.optional(Schema.Int.pipe(Schema.positive()))
})
export type SuperviseSpec = typeof SuperviseSpec.Type
export const encodeSpec = Schema.encodeSync(Schema.parseJson(SuperviseSpec))
export const decodeSpec = Schema.decodeUnknown(Schema.parseJson(SuperviseSpec))

/** the ready pipe's fd in the supervisor process */
export const READY_FD = 3

/** the built CLI that runs supervisors: `$ABOX_CLI`, this CLI itself, or dist/abox.js beside the SDK */
const cliEntry = Effect.gen(function* () {
  const configured = yield* Config.string("ABOX_CLI").pipe(Config.option)
  if (Option.isSome(configured)) return configured.value
  const self = process.argv[1]
  if (self !== undefined && path.basename(self) === "abox.js") return self
  const here = path.dirname(fileURLToPath(import.meta.url))
  const candidates = [path.join(here, "abox.js"), path.resolve(here, "..", "..", "dist", "abox.js")]
  const found = candidates.find((file) => fs.existsSync(file))
  if (found === undefined)
    return yield* new ControlError({
      reason: "spawn",
      message: `cannot find the abox CLI (looked at ${candidates.join(", ")}); set ABOX_CLI`
    })
  return found
})

/**
 * Starts `abox supervise` in the background (its own process group, stdio to
 * `$ABOX_HOME/supervisor.log`) and waits for its one line on the ready pipe: ready (the
 * session's id, the supervisor's pid) or the typed error that stopped it. The supervisor inherits
 * this environment (the broker reads credentials from it), never a secret on its command line.
 */
export const startDetached = Effect.fn("detached.start")(function* (spec: SuperviseSpec) {
  const paths = yield* AboxPaths
  const cli = yield* cliEntry
  const logFile = paths.homeFile("supervisorLog")
  const log = yield* Effect.try({
    try: () => {
      fs.mkdirSync(paths.home, { recursive: true, mode: 0o700 })
      return fs.openSync(logFile, "a", 0o600)
    },
    catch: (cause) => new ControlError({ reason: "spawn", message: `${logFile}: ${String(cause)}` })
  })
  const line = yield* Effect.async<string | undefined, ControlError>((resume) => {
    // a small young generation: the supervisor lives as long as its session, and V8's default
    // semi-spaces (16 MiB) let its RSS swing by tens of MiB under a burst of control requests
    const child = spawn(
      process.execPath,
      ["--max-semi-space-size=1", cli, "supervise", "--spec", encodeSpec(spec)],
      {
        detached: true,
        stdio: ["ignore", log, log, "pipe"],
        env: process.env
      }
    )
    fs.closeSync(log)
    const ready = child.stdio[READY_FD] as net.Socket | null
    let text = ""
    let done = false
    const finish = (result: string | undefined) => {
      if (done) return
      done = true
      ready?.destroy()
      child.unref()
      resume(Effect.succeed(result))
    }
    child.once("error", (error) => {
      done = true
      resume(
        Effect.fail(
          new ControlError({ reason: "spawn", message: `cannot start the supervisor: ${error.message}` })
        )
      )
    })
    ready?.on("data", (chunk: Buffer) => {
      text += chunk.toString("utf8")
      const newline = text.indexOf("\n")
      if (newline >= 0) finish(text.slice(0, newline))
    })
    ready?.once("end", () => finish(undefined))
    ready?.once("error", () => finish(undefined))
  })
  if (line === undefined)
    return yield* new ControlError({
      reason: "spawn",
      message: `the supervisor exited before it was ready; see ${logFile}`
    })
  const decoded = decodeReadyLine(line)
  if (Either.isLeft(decoded))
    return yield* new ControlError({
      reason: "protocol",
      message: `the supervisor's ready line: ${decoded.left.message}`
    })
  const ready = decoded.right
  if (ready.type === "failed") return yield* remoteError(ready.error)
  return ready
})

// ---- control connections ----

/** how long a supervisor may take to answer a connection's handshake */
const HANDSHAKE_TIMEOUT = Duration.seconds(10)

/**
 * A connection to the supervisor of `ref` (id or name) past its handshake, closed with the
 * scope: the versions agreed, or the supervisor's typed refusal. No supervisor (no socket, or a
 * stale one nobody listens on) → `SessionNotRunning`; one of another version →
 * `ControlVersionMismatch` (an older one answers our hello with its own protocol's error line).
 */
const dial = Effect.fn("detached.dial")(function* (ref: string, forwardPort?: number) {
  const store = yield* SessionStore
  const { id: sessionId, dir } = yield* store.locate(ref)
  const socketPath = controlSocketPath(dir)
  const socket = yield* Effect.acquireRelease(
    connectUnix(socketPath).pipe(
      Effect.mapError((failure) =>
        failure.refused
          ? new SessionNotRunning({
              sessionId,
              message: `session ${ref} is not running detached (abox start ${ref} starts it)`
            })
          : new ControlError({ reason: "connect", message: failure.message })
      )
    ),
    (socket) => Effect.sync(() => socket.destroy())
  )
  const lines = new LineSocket(socket)
  yield* writeLine(
    socket,
    encodeHello({
      type: "hello",
      version: CONTROL_VERSION,
      ...(forwardPort === undefined ? {} : { forward: forwardPort })
    })
  )
  const answer = yield* readLine(lines).pipe(
    Effect.timeoutFail({
      duration: HANDSHAKE_TIMEOUT,
      onTimeout: () =>
        new ControlError({
          reason: "handshake",
          message: `the supervisor of ${ref} did not answer the handshake`
        })
    })
  )
  if (Option.isNone(answer))
    return yield* new ControlError({ reason: "closed", message: "the supervisor closed the connection" })
  const welcome = decodeWelcome(answer.value)
  if (Either.isLeft(welcome))
    return yield* new ControlVersionMismatch({
      version: CONTROL_VERSION,
      peer: null,
      message: `the supervisor of session ${ref} speaks an older control protocol than this abox (v${CONTROL_VERSION}): stop it with the abox that started it, then start it again`
    })
  if (welcome.right.type === "refused") return yield* refusalOf(welcome.right.error)
  return { sessionId, socket, lines }
})

/** an RpcClient call's failure of the connection itself */
const connectionLost = (error: RpcClientError) =>
  new ControlError({ reason: "closed", message: `control connection: ${error.message}` })

const makeClient = RpcClient.make(ControlRpcs)
export type ControlClient = Effect.Effect.Success<typeof makeClient>

/**
 * The control plane of the session `ref` (id or name): an RpcClient of `ControlRpcs` on a
 * connection of its own, closed with the scope. A connection that breaks fails every call on it
 * (RpcClientError); it is not dialled again.
 */
export const connect = Effect.fn("detached.connect")(function* (ref: string) {
  const { sessionId, lines } = yield* dial(ref)
  const socket = yield* NodeSocket.fromDuplex(Effect.sync(() => duplexAfter(lines)))
  const protocol = yield* RpcClient.makeProtocolSocket({ retrySchedule: Schedule.stop }).pipe(
    Effect.provideService(Socket.Socket, socket),
    Effect.provideService(RpcSerialization.RpcSerialization, controlSerialization)
  )
  const client = yield* makeClient.pipe(Effect.provideService(RpcClient.Protocol, protocol))
  return { sessionId, client }
})

/** a running session's supervisor: pid, start time, clients, the turn running now */
export const status = (ref: string) =>
  Effect.scoped(
    Effect.flatMap(connect(ref), ({ client }) => client.Status().pipe(Effect.mapError(connectionLost)))
  )

/** like `status`, with None for a session nobody serves */
export const statusIfRunning = (ref: string): Effect.Effect<Option.Option<StatusInfo>, never, SessionStore> =>
  status(ref).pipe(Effect.timeout(Duration.seconds(5)), Effect.option)

export interface StopOptions {
  /** how long Close may take before the bounded kill path (default 60 s) */
  readonly timeout?: Duration.DurationInput | undefined
  /** after SIGTERM, how long before SIGKILL (default 30 s) */
  readonly terminateWait?: Duration.DurationInput | undefined
  /** save the VM's memory first (`abox suspend`): the next start restores it */
  readonly suspend?: boolean | undefined
}

/** is a process with this pid still there? */
const processAlive = (pid: number): boolean => {
  try {
    process.kill(pid, 0)
    return true
  } catch (error) {
    return (error as NodeJS.ErrnoException).code === "EPERM"
  }
}

/** waits (bounded) for `pid` to be gone; another process's exit has no event here, so it is watched */
const waitGone = (pid: number, within: Duration.Duration) =>
  Effect.gen(function* () {
    while (processAlive(pid)) yield* Effect.sleep(Duration.millis(50))
  }).pipe(Effect.timeout(within), Effect.isSuccess)

/**
 * Stop: the supervisor runs Close (shutdown → bounded stop of the VM → unlock) and exits; this
 * returns when its connection ends, i.e. when the process is gone. Past `timeout` it takes the
 * bounded kill path: SIGTERM (Close again, from the signal), then SIGKILL (the VMM helper's
 * liveness pipe then stops the VM). Returns how it ended.
 */
export const stop = Effect.fn("detached.stop")(function* (ref: string, options: StopOptions = {}) {
  const timeout = Duration.decode(options.timeout ?? Duration.seconds(60))
  return yield* Effect.scoped(
    Effect.gen(function* () {
      const { client } = yield* connect(ref)
      // `Stopping`, then nothing until the connection ends with the process
      const replies = yield* Stream.toPull(client.Stop({ suspend: options.suspend === true }))
      const first = yield* replies.pipe(
        Effect.mapError(
          Option.match({
            onNone: () =>
              new ControlError({ reason: "closed", message: "the supervisor closed the connection" }),
            onSome: (error) => (error._tag === "RpcClientError" ? connectionLost(error) : error)
          })
        )
      )
      const pid = first.pipe((chunk) => [...chunk][0]?.pid)
      if (pid === undefined)
        return yield* new ControlError({ reason: "protocol", message: "no Stopping from the supervisor" })
      const closed = yield* replies.pipe(
        Effect.forever,
        Effect.ignore,
        Effect.timeout(timeout),
        Effect.isSuccess
      )
      if (closed) {
        // the connection ends as the process exits: give it a moment to be reaped
        yield* waitGone(pid, Duration.seconds(5))
        return { how: "stopped" as const, pid }
      }
      yield* Effect.sync(() => process.kill(pid, "SIGTERM")).pipe(Effect.ignore)
      if (yield* waitGone(pid, Duration.decode(options.terminateWait ?? Duration.seconds(30))))
        return { how: "terminated" as const, pid }
      yield* Effect.sync(() => process.kill(pid, "SIGKILL")).pipe(Effect.ignore)
      yield* waitGone(pid, Duration.seconds(5))
      return { how: "killed" as const, pid }
    })
  )
})

/**
/**
 * A running session frozen for a fork (the `Fork` RPC): its disks become frozen layers, its
 * memory is saved into `statePath`, it runs on. Returns the frozen layers and the saved state's
 * manifest.
 */
export const freeze = Effect.fn("detached.freeze")(function* (ref: string, statePath: string) {
  return yield* Effect.scoped(
    Effect.flatMap(connect(ref), ({ client }) =>
      client
        .Fork({ statePath })
        .pipe(Effect.mapError((error) => (error._tag === "RpcClientError" ? connectionLost(error) : error)))
    )
  )
})

/**
 * One turn in a running session, as the in-process `Session.turn` gives it: the guest's events
 * (their exact bytes rebuilt), then `End`. Interrupting the stream (leaving a loop early)
 * cancels the turn, as in-process. With `tty`, `controls` are its keys, sizes and signals.
 */
export const remoteTurn = (
  ref: string,
  request: TurnRequest,
  controls?: Stream.Stream<
    | { readonly _tag: "Input"; readonly bytes: Uint8Array }
    | { readonly _tag: "Resize"; readonly rows: number; readonly cols: number }
    | {
        readonly _tag: "Signal"
        readonly signal: "SIGINT" | "SIGTERM" | "SIGHUP" | "SIGQUIT" | "SIGKILL" | "SIGUSR1" | "SIGUSR2"
      }
  >
) =>
  Stream.unwrapScoped(
    Effect.gen(function* () {
      const { client } = yield* connect(ref)
      const scope = yield* Effect.scope
      let ended = false
      // the caller left before the end: the turn is the supervisor's, so it is told to cancel
      yield* Effect.addFinalizer(() => (ended ? Effect.void : client.Cancel().pipe(Effect.ignore)))
      const turn = client.Turn(request).pipe(
        Stream.mapError((error) => (error._tag === "RpcClientError" ? connectionLost(error) : error)),
        Stream.tap((item) => Effect.sync(() => (ended = ended || item._tag === "Ended"))),
        Stream.tapError(() => Effect.sync(() => (ended = true)))
      )
      if (controls === undefined) return turn
      const send = controls.pipe(
        Stream.runForEach((control) =>
          control._tag === "Input"
            ? client.Input({ data: control.bytes })
            : control._tag === "Resize"
              ? client.Resize({ rows: control.rows, cols: control.cols })
              : client.Signal({ signal: control.signal })
        ),
        Effect.ignore
      )
      // the controls go once the turn has begun (before, the supervisor has no turn to give them)
      return turn.pipe(
        Stream.tap((item) => (item._tag === "Started" ? Effect.forkIn(send, scope) : Effect.void))
      )
    })
  ).pipe(Stream.withSpan("detached.turn", { attributes: { ref } }))

/** `remoteTurn` as `Session.turn` gives it: the guest's events (exact bytes), then `End` */
export const remoteTurnEvents = (
  ref: string,
  text: string,
  mode: "shell" | "prompt" = "shell",
  limits?: TurnLimits
): Stream.Stream<TurnEvent, RemoteTurnError, SessionStore> =>
  remoteTurn(ref, {
    text,
    ...(mode === "prompt" ? { mode } : {}),
    ...(limits === undefined ? {} : { limits })
  }).pipe(
    Stream.filterMap((item): Option.Option<TurnEvent> =>
      item._tag === "Event"
        ? Option.some(agentTurnEvent(item.event))
        : item._tag === "Ended"
          ? Option.some({
              _tag: "End",
              exitCode: item.exitCode,
              signal: item.signal,
              cancelled: item.cancelled
            })
          : Option.none()
    )
  )
export type RemoteTurnError = Stream.Stream.Error<ReturnType<typeof remoteTurn>>

export interface ForwardOptions {
  /** told once the host port listens (with the port, useful when 0 was asked) */
  readonly onListening?: ((port: number) => Effect.Effect<void>) | undefined
  /** told when a connection could not be forwarded (the guest refused it, …) */
  readonly onRefused?: ((error: ForwardRefusal) => Effect.Effect<void>) | undefined
}

/**
 * `abox forward`: listens on 127.0.0.1:<hostPort> (never another address); each connection gets
 * its own control connection asking for a forward to 127.0.0.1:<guestPort> in the guest. Runs
 * until interrupted or the session closes (a watching connection tells).
 */
export const forward = Effect.fn("detached.forward")(function* (
  ref: string,
  guestPort: number,
  hostPort: number,
  options: ForwardOptions = {}
) {
  const watch = yield* connect(ref)
  // the session closing ends this watch
  const watching = Stream.runDrain(watch.client.Attach({ typist: false })).pipe(Effect.ignore)
  const listener = yield* listenLoopback(hostPort)
  if (options.onListening !== undefined) yield* options.onListening(listener.port)
  const one = (tcp: net.Socket) =>
    Effect.gen(function* () {
      yield* Effect.addFinalizer(() => Effect.sync(() => tcp.destroy()))
      tcp.pause()
      const dialled = yield* dial(ref, guestPort).pipe(Effect.either)
      if (Either.isLeft(dialled)) {
        if (options.onRefused !== undefined) yield* options.onRefused(dialled.left)
        return
      }
      // what the supervisor sent past its welcome is the guest's first bytes: to the TCP client first
      yield* splice(dialled.right.socket, tcp, dialled.right.lines.takeRaw())
    }).pipe(Effect.scoped, Effect.ignore)
  const serveAll = Queue.take(listener.connections).pipe(
    Effect.flatMap((tcp) => Effect.forkScoped(one(tcp))),
    Effect.forever
  )
  yield* Effect.raceFirst(serveAll, watching)
})
export type ForwardRefusal = Effect.Effect.Error<ReturnType<typeof dial>>

// ---- repository operations on a running session ----

/** a call's RpcClientError (the connection broke) as ControlError */
const mapRpc = <A, E>(effect: Effect.Effect<A, E | RpcClientError>) =>
  Effect.mapError(effect, (error) =>
    (error as { _tag?: unknown })._tag === "RpcClientError"
      ? connectionLost(error as RpcClientError)
      : (error as E)
  )

/**
 * The Session contract of the session `ref` through its supervisor: turns, and the repository
 * operations (docs/detached.md "Repository operations"), each on a connection of its own; the
 * supervisor runs them on its session's connection, as on a stopped session. Host paths are
 * made absolute here (the supervisor has its own working directory).
 */
export const remoteSession = (ref: string) => {
  const on = <A, E>(call: (client: ControlClient) => Effect.Effect<A, E | RpcClientError>) =>
    Effect.scoped(Effect.flatMap(connect(ref), ({ client }) => mapRpc(call(client))))
  return {
    diff: (options = {}) =>
      Effect.scoped(
        Effect.flatMap(connect(ref), ({ client }) =>
          client.Diff({ stat: options.stat, paths: options.paths }).pipe(
            Stream.mapError((error) => (error._tag === "RpcClientError" ? connectionLost(error) : error)),
            Stream.runFoldEffect("", (text, piece) =>
              text.length + piece.length > MAX_REMOTE_PATCH
                ? new ControlError({
                    reason: "too large",
                    message: `the diff is larger than ${MAX_REMOTE_PATCH} characters; stop the session and use abox diff on it`
                  })
                : Effect.succeed(text + piece)
            )
          )
        )
      ),
    apply: (options) => on((client) => client.Apply({ ...options, to: path.resolve(options.to) })),
    copyOut: (guestPath, hostPath, options = {}) =>
      on((client) =>
        client.CopyOut({ guestPath, hostPath: path.resolve(hostPath), includeGit: options.includeGit })
      ),
    copyIn: (hostPath, guestDir) =>
      on((client) => client.CopyIn({ hostPath: path.resolve(hostPath), guestDir })),
    readFile: (guestPath) => on((client) => client.ReadFile({ path: guestPath })),
    writeFile: (guestPath, data, mode) =>
      on((client) =>
        client.WriteFile({
          path: guestPath,
          data: typeof data === "string" ? new TextEncoder().encode(data) : data,
          mode
        })
      ),
    listFiles: (guestPath) => on((client) => client.ListFiles({ path: guestPath })),
    turn: (text, mode, limits) => remoteTurnEvents(ref, text, mode, limits)
  } satisfies SessionContract<unknown, SessionStore>
}
export type RemoteSession = ReturnType<typeof remoteSession>
export type RemoteError = Effect.Effect.Error<ReturnType<RemoteSession["diff"]>> | RemoteTurnError

/**
 * `operation` on a session's repository: through its supervisor when one serves it, else on a
 * connection of its own (booted for it and closed again: `Repo.withConnection`). Either way the
 * same contract (SessionRepo).
 */
export const withRepo = <A, E, R>(ref: string, operation: (repo: AnyRepo) => Effect.Effect<A, E, R>) =>
  Effect.gen(function* () {
    const running = yield* statusIfRunning(ref)
    if (Option.isSome(running)) return yield* operation(remoteSession(running.value.sessionId))
    return yield* Repo.withConnection(ref, (connection) => operation(Repo.localRepo(connection)))
  })
type ErrorsOf<T> = {
  [K in keyof T]: T[K] extends (...args: ReadonlyArray<never>) => Effect.Effect<unknown, infer E, unknown>
    ? E
    : never
}[keyof T]
/** a session's repository on either side */
export type AnyRepo = SessionRepo<
  ErrorsOf<ReturnType<typeof Repo.localRepo>> | ErrorsOf<Omit<RemoteSession, "turn">>,
  SessionStore | CommandExecutor.CommandExecutor
>
