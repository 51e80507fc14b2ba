/**
 * Clients of a detached session (docs/detached.md): start a supervisor in the background, and
 * talk to a running one over its control socket (status, turns, attach, stop, forward). The CLI
 * and the SDK share these.
 */
import * as Config from "effect/Config"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Option from "effect/Option"
import * as Queue from "effect/Queue"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import type * as net from "node:net"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { connectUnix, LineSocket, listenLoopback, readLine, splice, writeLine } from "../lib/lineSocket.js"
import { SourceInvalid } from "../lib/snapshot.js"
import { controlSocketPath } from "../lib/socketPath.js"
import type { TurnLimits } from "../protocol/Messages.js"
import {
  ControlError,
  ControlRefused,
  type ControlReply,
  type ControlRequest,
  decodeReadyLine,
  decodeReply,
  encodeRequest,
  type ErrorFields,
  MAX_REMOTE_PATCH,
  type RepoDone,
  type RepoOp,
  SessionNotRunning,
  type StatusReply
} from "../protocol/Control.js"
import { AboxPaths } from "../services/AboxPaths.js"
import {
  agentTurnEvent,
  type TurnEvent,
  ForwardRefused,
  GuestDisconnected,
  GuestTimeout,
  GuestTooNew,
  GuestTooOld,
  ProtocolError,
  TtyUnsupported
} from "../services/GuestRpc.js"
import { BrokerError, BrokerPolicyError } from "../services/HttpsBroker.js"
import { DiskError, ImageNotFound } from "../domain/image.js"
import { TransferFailed } from "../domain/transfer.js"
import { LockError, SessionBusy } from "../services/RuntimeLock.js"
import {
  InvalidName,
  NameTaken,
  SessionCorrupt,
  SessionFormatTooNew,
  SessionNotFound,
  SessionStore,
  StoreIoError
} from "../services/SessionStore.js"
import {
  ArchiveRefused,
  MergeConflicts,
  PatchFailed,
  RepoPathInvalid,
  RepoToolFailed,
  SourceChanged
} from "../domain/repoErrors.js"
import { VmmError, VmmUnavailable } from "../domain/vm.js"
import { SessionIncompatible } from "./compat.js"

// ---- errors across the process boundary ----

/** the errors a supervisor may report, decoded back into their classes on the client */
const KnownError = Schema.Union(
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
  SessionNotRunning,
  ControlError,
  ForwardRefused,
  ArchiveRefused,
  SourceChanged,
  MergeConflicts,
  PatchFailed,
  RepoToolFailed,
  RepoPathInvalid,
  TtyUnsupported
)
export type RemoteError = typeof KnownError.Type | ControlRefused
const decodeKnown = Schema.decodeUnknownEither(KnownError)

/** an error a supervisor sent, as its own class when known (so it maps to its own exit code) */
export const remoteError = (fields: ErrorFields): RemoteError =>
  Either.getOrElse(
    decodeKnown(fields),
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
    const child = spawn(process.execPath, [cli, "supervise", "--spec", encodeSpec(spec)], {
      detached: true,
      stdio: ["ignore", log, log, "pipe"],
      env: process.env
    })
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

export interface ControlConnection {
  readonly sessionId: string
  readonly socket: net.Socket
  readonly send: (request: ControlRequest) => Effect.Effect<void, ControlError>
  /** the next reply; None when the supervisor closed the connection */
  readonly next: Effect.Effect<Option.Option<ControlReply>, ControlError>
  /** every reply until the connection ends */
  readonly replies: Stream.Stream<ControlReply, ControlError>
  /** leave line mode (after `forward_ok`): the bytes already read past the last line */
  readonly takeRaw: () => Buffer
}

/**
 * A connection to the supervisor of `ref` (id or name), closed with the scope. No supervisor
 * (no socket, or a stale one nobody listens on) → `SessionNotRunning`.
 */
export const connect = Effect.fn("detached.connect")(function* (ref: string) {
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
  const next = readLine(lines).pipe(
    Effect.flatMap(
      Option.match({
        onNone: () => Effect.succeed(Option.none<ControlReply>()),
        onSome: (line) =>
          Either.match(decodeReply(line), {
            onLeft: (error) =>
              Effect.fail(
                new ControlError({ reason: "protocol", message: `supervisor reply: ${error.message}` })
              ),
            onRight: (reply) => Effect.succeed(Option.some(reply))
          })
      })
    )
  )
  return {
    sessionId,
    socket,
    send: (request: ControlRequest) => writeLine(socket, encodeRequest(request)),
    next,
    takeRaw: () => lines.takeRaw(),
    replies: Stream.repeatEffectOption(
      next.pipe(
        Effect.mapError(Option.some),
        Effect.flatMap(Option.match({ onNone: () => Effect.fail(Option.none()), onSome: Effect.succeed }))
      )
    )
  } satisfies ControlConnection
})

/** the first reply to `request`; an `error` reply fails with its typed error */
const ask = (connection: ControlConnection, request: ControlRequest) =>
  Effect.gen(function* () {
    yield* connection.send(request)
    const reply = yield* connection.next
    if (Option.isNone(reply))
      return yield* new ControlError({ reason: "closed", message: "the supervisor closed the connection" })
    if (reply.value.type === "error") return yield* remoteError(reply.value.error)
    return reply.value
  })

/** a running session's supervisor: pid, start time, clients, the turn running now */
export const status = (ref: string) =>
  Effect.scoped(
    Effect.gen(function* () {
      const connection = yield* connect(ref)
      const reply = yield* ask(connection, { type: "status" })
      if (reply.type !== "status")
        return yield* new ControlError({ reason: "protocol", message: `expected status, got ${reply.type}` })
      return reply
    })
  )

/** like `status`, with None for a session nobody serves */
export const statusIfRunning = (
  ref: string
): Effect.Effect<Option.Option<StatusReply>, never, SessionStore> =>
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
      const connection = yield* connect(ref)
      const reply = yield* ask(connection, {
        type: "stop",
        ...(options.suspend === true ? { suspend: true } : {})
      })
      if (reply.type !== "stopping")
        return yield* new ControlError({
          reason: "protocol",
          message: `expected stopping, got ${reply.type}`
        })
      const closed = yield* Stream.runDrain(connection.replies).pipe(
        Effect.ignore,
        Effect.timeout(timeout),
        Effect.isSuccess
      )
      if (closed) {
        // the connection ends as the process exits: give it a moment to be reaped
        yield* waitGone(reply.pid, Duration.seconds(5))
        return { how: "stopped" as const, pid: reply.pid }
      }
      yield* Effect.sync(() => process.kill(reply.pid, "SIGTERM")).pipe(Effect.ignore)
      if (yield* waitGone(reply.pid, Duration.decode(options.terminateWait ?? Duration.seconds(30))))
        return { how: "terminated" as const, pid: reply.pid }
      yield* Effect.sync(() => process.kill(reply.pid, "SIGKILL")).pipe(Effect.ignore)
      yield* waitGone(reply.pid, Duration.seconds(5))
      return { how: "killed" as const, pid: reply.pid }
    })
  )
})

/**
 * One turn in a running session, as the in-process `Session.turn` gives it: the guest's events,
 * then `End`. Interrupting the stream (leaving a loop early) cancels the turn, as in-process.
 */
export const remoteTurn = (
  ref: string,
  text: string,
  mode: "shell" | "prompt" = "shell",
  limits?: TurnLimits
): Stream.Stream<TurnEvent, RemoteError, SessionStore> =>
  Stream.unwrapScoped(
    Effect.gen(function* () {
      const connection = yield* connect(ref)
      yield* connection.send({
        type: "turn",
        text,
        ...(mode === "prompt" ? { mode } : {}),
        ...(limits === undefined ? {} : { limits })
      })
      let ended = false
      yield* Effect.addFinalizer(() =>
        ended ? Effect.void : connection.send({ type: "cancel" }).pipe(Effect.ignore)
      )
      return connection.replies.pipe(
        Stream.takeUntil((reply) => reply.type === "turn_end" || reply.type === "error"),
        Stream.mapEffect((reply): Effect.Effect<Option.Option<TurnEvent>, RemoteError> => {
          switch (reply.type) {
            case "event":
              // the exact bytes rebuilt from the relayed event, as in-process
              return Effect.succeed(Option.some(agentTurnEvent(reply.event)))
            case "turn_end":
              ended = true
              return Effect.succeed(
                Option.some({
                  _tag: "End",
                  exitCode: reply.exitCode,
                  signal: reply.signal,
                  cancelled: reply.cancelled
                })
              )
            case "error":
              ended = true
              return Effect.fail(remoteError(reply.error))
            default:
              return Effect.succeed(Option.none())
          }
        }),
        Stream.filterMap((event) => event)
      )
    })
  ).pipe(Stream.withSpan("detached.turn", { attributes: { ref, mode } }))

export interface ForwardOptions {
  /** told once the host port listens (with the port, useful when 0 was asked) */
  readonly onListening?: ((port: number) => Effect.Effect<void>) | undefined
  /** told when a connection could not be forwarded (the guest refused it, …) */
  readonly onRefused?: ((error: RemoteError) => Effect.Effect<void>) | undefined
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
  yield* watch.send({ type: "attach", typist: false })
  const listener = yield* listenLoopback(hostPort)
  if (options.onListening !== undefined) yield* options.onListening(listener.port)
  const one = (tcp: net.Socket) =>
    Effect.gen(function* () {
      yield* Effect.addFinalizer(() => Effect.sync(() => tcp.destroy()))
      tcp.pause()
      const connection = yield* connect(ref)
      yield* connection.send({ type: "forward", port: guestPort })
      const reply = yield* connection.next
      if (Option.isNone(reply)) return
      if (reply.value.type === "error") {
        if (options.onRefused !== undefined) yield* options.onRefused(remoteError(reply.value.error))
        return
      }
      // what the supervisor sent past forward_ok is the guest's first bytes: to the TCP client first
      yield* splice(connection.socket, tcp, connection.takeRaw())
    }).pipe(Effect.scoped, Effect.ignore)
  const serveAll = Queue.take(listener.connections).pipe(
    Effect.flatMap((tcp) => Effect.forkScoped(one(tcp))),
    Effect.forever
  )
  // the session closing ends the watching connection
  yield* Effect.raceFirst(serveAll, Stream.runDrain(watch.replies).pipe(Effect.ignore))
})

// ---- repository operations on a running session ----

/**
 * A repository operation run by the supervisor of a running session (docs/detached.md
 * "Repository operations"): host paths made absolute here (the supervisor has its own working
 * directory); a diff's pieces joined, at most MAX_REMOTE_PATCH characters.
 */
export const remoteRepo = (
  ref: string,
  request: RepoOp
): Effect.Effect<{ readonly text: string; readonly done: RepoDone }, RemoteError, SessionStore> =>
  Effect.scoped(
    Effect.gen(function* () {
      const absolute: RepoOp =
        request.op === "apply"
          ? { ...request, to: path.resolve(request.to) }
          : request.op === "copy_out" || request.op === "copy_in"
            ? { ...request, hostPath: path.resolve(request.hostPath) }
            : request
      const connection = yield* connect(ref)
      yield* connection.send({ type: "repo", request: absolute })
      const chunks: Array<string> = []
      let size = 0
      while (true) {
        const next = yield* connection.next
        if (Option.isNone(next))
          return yield* new ControlError({
            reason: "closed",
            message: "the supervisor closed the connection before the operation ended"
          })
        const reply = next.value
        switch (reply.type) {
          case "repo_data":
            size += reply.data.length
            if (size > MAX_REMOTE_PATCH)
              return yield* new ControlError({
                reason: "too large",
                message: `the diff is larger than ${MAX_REMOTE_PATCH} characters; stop the session and use abox diff on it`
              })
            chunks.push(reply.data)
            break
          case "repo_done":
            return { text: chunks.join(""), done: reply }
          case "error":
            return yield* Effect.fail(remoteError(reply.error))
          default:
            return yield* new ControlError({
              reason: "protocol",
              message: `unexpected reply to a repository operation: ${reply.type}`
            })
        }
      }
    })
  )

/**
 * `operation` on a session: through its supervisor when one serves it (`remote`), else on a
 * connection of its own (booted for it and closed again: `Repo.withConnection`)
 */
export const viaSupervisorOr = <A, E, R, B>(
  ref: string,
  remote: RepoOp,
  fromRemote: (result: { readonly text: string; readonly done: RepoDone }) => B,
  local: Effect.Effect<A, E, R>
): Effect.Effect<A | B, E | RemoteError, R | SessionStore> =>
  Effect.flatMap(statusIfRunning(ref), (running): Effect.Effect<A | B, E | RemoteError, R | SessionStore> =>
    Option.isSome(running) ? Effect.map(remoteRepo(running.value.sessionId, remote), fromRemote) : local
  )
