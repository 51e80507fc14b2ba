/**
 * The control plane of a detached session (docs/detached.md) as an `RpcGroup`: one entry per
 * operation, each with its own payload, success and error schemas. `RpcServer` serves it in the
 * supervisor over the session's control socket (`control.sock`, 0600), `RpcClient` calls it from
 * the CLI and the SDK; the wire is @effect/rpc's NDJSON (one message a line, at most
 * MAX_CONTROL_LINE bytes).
 *
 * A connection begins with one handshake line each way (`ControlHello`, then `ControlWelcome`
 * or an error) that checks CONTROL_VERSION before anything else: a client and a supervisor of
 * different versions part with a typed `ControlVersionMismatch`, not a decode failure or a hang.
 * The handshake also says what the connection carries: RPC messages, or (a port forward) raw
 * bytes to a port in the guest.
 *
 * Adding an operation is one entry here and one handler in programs/supervisor.ts.
 */
import * as Rpc from "@effect/rpc/Rpc"
import * as RpcGroup from "@effect/rpc/RpcGroup"
import * as RpcSerialization from "@effect/rpc/RpcSerialization"
import * as Schema from "effect/Schema"
import { SourceInvalid, TransferFailed } from "../domain/transfer.js"
import { SnapshotUnsupported, StateManifest, SuspendRefused } from "../domain/memoryState.js"
import { DiskError } from "../domain/image.js"
import { VmmError } from "../domain/vm.js"
import { StoreIoError } from "./SessionStore.js"
import {
  ArchiveRefused,
  MergeConflicts,
  PatchFailed,
  RepoPathInvalid,
  RepoToolFailed,
  SourceChanged
} from "../domain/repoErrors.js"
import {
  ForwardRefused,
  GuestDisconnected,
  GuestTimeout,
  GuestTooNew,
  GuestTooOld,
  ProtocolError,
  TtyUnsupported
} from "./GuestRpc.js"
import {
  ControlError,
  MAX_CONTROL_LINE,
  MAX_REMOTE_FILE_BYTES,
  TurnRequest,
  ErrorFields
} from "../protocol/Control.js"
export { CONTROL_VERSION, ControlVersionMismatch } from "../protocol/Control.js"
import { AgentEvent, Hello, TurnSignalName } from "../protocol/Messages.js"

// ---- errors, per operation ----

/** what a turn may fail with: the guest's errors, a terminal turn on a guest without them, a bad request */
export const TurnRpcError = Schema.Union(
  GuestTooOld,
  GuestTooNew,
  ProtocolError,
  GuestTimeout,
  GuestDisconnected,
  TtyUnsupported,
  ControlError
)
/** what a repository operation may fail with (src/programs/repo.ts) */
export const RepoRpcError = Schema.Union(
  GuestTooOld,
  GuestTooNew,
  ProtocolError,
  GuestTimeout,
  GuestDisconnected,
  TransferFailed,
  SourceInvalid,
  ArchiveRefused,
  SourceChanged,
  MergeConflicts,
  PatchFailed,
  RepoToolFailed,
  RepoPathInvalid,
  ControlError
)
export { ForwardRefused }
/** what a Stop that suspends may fail with (src/programs/suspend.ts): refused, the session runs on */
export const SuspendRpcError = Schema.Union(SuspendRefused, SnapshotUnsupported, VmmError, StoreIoError)
/** what a Fork may fail with (src/programs/suspend.ts `freezeVm`): as a suspend, a disk's tool, a bad request */
export const ForkRpcError = Schema.Union(
  SuspendRefused,
  SnapshotUnsupported,
  VmmError,
  StoreIoError,
  DiskError,
  ControlError
)

// ---- successes ----

export const StatusInfo = Schema.Struct({
  version: Schema.Number,
  sessionId: Schema.String,
  pid: Schema.Number,
  /** ISO time the supervisor became ready */
  started: Schema.String,
  /** connected clients, this one included */
  clients: Schema.Number,
  /** the turn running now, if any */
  turn: Schema.NullOr(Schema.Number),
  hello: Hello,
  /** when it closes itself after no client and no turn (ms), if ever */
  idleTimeoutMs: Schema.NullOr(Schema.Number)
})
export type StatusInfo = typeof StatusInfo.Type

/** a turn began (to its starter, and to every watcher with its text; `mine`: this attached client typed it) */
export const TurnStarted = Schema.TaggedStruct("Started", {
  turn: Schema.Number,
  text: Schema.String,
  mine: Schema.optional(Schema.Boolean)
})
/** one of the turn's events (its bytes exact: `data`, or `base64` when not UTF-8; see agentTurnEvent) */
export const TurnEventOut = Schema.TaggedStruct("Event", { turn: Schema.Number, event: AgentEvent })
export const TurnEnded = Schema.TaggedStruct("Ended", {
  turn: Schema.Number,
  exitCode: Schema.NullOr(Schema.Number),
  signal: Schema.NullOr(Schema.String),
  cancelled: Schema.Boolean,
  /** cancelled by the request's timeoutMs */
  timedOut: Schema.Boolean
})
export type TurnEnded = typeof TurnEnded.Type
/** to watchers: a turn failed (the guest went away, a bad request from the typist) */
export const TurnFailed = Schema.TaggedStruct("Failed", {
  turn: Schema.NullOr(Schema.Number),
  error: ErrorFields
})
export const TurnOutput = Schema.Union(TurnStarted, TurnEventOut, TurnEnded)
export type TurnOutput = typeof TurnOutput.Type

/** attach's first element: whether this client types, and what a typed line is */
export const Attached = Schema.TaggedStruct("Attached", {
  typist: Schema.Boolean,
  /** "prompt" for the model agent, "shell" when the session has an agent command */
  lines: Schema.Literal("prompt", "shell")
})
export const AttachOutput = Schema.Union(Attached, TurnStarted, TurnEventOut, TurnEnded, TurnFailed)
export type AttachOutput = typeof AttachOutput.Type

export const RepoEntry = Schema.Struct({
  path: Schema.String,
  type: Schema.Literal("file", "directory", "symlink"),
  size: Schema.Number,
  mode: Schema.Number
})
export const Counted = Schema.Struct({ files: Schema.Number, bytes: Schema.Number })

/** host paths are absolute: the client resolves them (the supervisor has its own working directory) */
const HostPath = Schema.String.pipe(
  Schema.filter((p) => p.startsWith("/") || `not an absolute host path: ${p}`)
)

// ---- the group ----

export class ControlRpcs extends RpcGroup.make(
  Rpc.make("Status", { success: StatusInfo }),
  /**
   * `Stopping` at once; the stream then ends only with the connection, when the process exits
   * after Close. With `suspend` the VM's memory is saved first (the next start restores it): a
   * refused save fails the call and the session runs on.
   */
  Rpc.make("Stop", {
    payload: { suspend: Schema.optional(Schema.Boolean) },
    success: Schema.TaggedStruct("Stopping", { pid: Schema.Number }),
    error: SuspendRpcError,
    stream: true
  }),
  /**
   * Freeze the running session for a fork (src/programs/fork.ts): its disks become frozen layers
   * and it goes on in new overlays over them, its memory saved into `statePath` (a file in the
   * new session's directory) while it is stopped; the frozen layers' paths and the manifest
   */
  Rpc.make("Fork", {
    payload: { statePath: HostPath },
    success: Schema.Struct({
      root: Schema.String,
      repo: Schema.optional(Schema.String),
      manifest: StateManifest
    }),
    error: ForkRpcError
  }),
  /**
   * One turn, of whatever kind the session runs; its `Started`, events, then `Ended`. The turn
   * is the supervisor's: a client that goes away leaves it running (`Cancel` stops it).
   */
  Rpc.make("Turn", { payload: TurnRequest, success: TurnOutput, error: TurnRpcError, stream: true }),
  /** cancel the turn this connection started (nothing if none runs) */
  Rpc.make("Cancel"),
  /** a tty turn's typed bytes, from the connection that started it */
  Rpc.make("Input", { payload: { data: Schema.Uint8ArrayFromBase64 } }),
  /** the tty turn's terminal changed size */
  Rpc.make("Resize", {
    payload: {
      rows: Schema.Int.pipe(Schema.between(1, 0xffff)),
      cols: Schema.Int.pipe(Schema.between(1, 0xffff))
    }
  }),
  /** a signal to the tty turn's command */
  Rpc.make("Signal", { payload: { signal: TurnSignalName } }),
  /** every turn as it runs (the running one replayed first); `typist: true` asks to type */
  Rpc.make("Attach", {
    payload: { typist: Schema.Boolean },
    success: AttachOutput,
    stream: true
  }),
  /** the typist's line: a turn run by the supervisor, seen through Attach */
  Rpc.make("Type", { payload: TurnRequest, success: Schema.Void, error: ControlError }),
  /** the changes since Open as a git patch, in pieces of at most REPO_CHUNK characters */
  Rpc.make("Diff", {
    payload: {
      stat: Schema.optional(Schema.Boolean),
      paths: Schema.optional(Schema.Array(Schema.String))
    },
    success: Schema.String,
    error: RepoRpcError,
    stream: true
  }),
  Rpc.make("Apply", {
    payload: {
      to: HostPath,
      check: Schema.optional(Schema.Boolean),
      threeWay: Schema.optional(Schema.Boolean),
      paths: Schema.optional(Schema.Array(Schema.String))
    },
    success: Schema.Array(Schema.String),
    error: RepoRpcError
  }),
  Rpc.make("CopyOut", {
    payload: {
      guestPath: Schema.String,
      hostPath: HostPath,
      includeGit: Schema.optional(Schema.Boolean)
    },
    success: Schema.Struct({ ...Counted.fields, path: Schema.String }),
    error: RepoRpcError
  }),
  Rpc.make("CopyIn", {
    payload: { hostPath: HostPath, guestDir: Schema.String },
    success: Counted,
    error: RepoRpcError
  }),
  /** one file's bytes (at most MAX_REMOTE_FILE_BYTES: larger ones go by CopyOut) */
  Rpc.make("ReadFile", {
    payload: { path: Schema.String },
    success: Schema.Uint8ArrayFromBase64,
    error: RepoRpcError
  }),
  /** one file written with its permission bits; the bytes written */
  Rpc.make("WriteFile", {
    payload: {
      path: Schema.String,
      data: Schema.Uint8ArrayFromBase64.pipe(
        Schema.filter(
          (bytes) => bytes.length <= MAX_REMOTE_FILE_BYTES || `more than ${MAX_REMOTE_FILE_BYTES} bytes`
        )
      ),
      mode: Schema.optional(Schema.Int.pipe(Schema.between(0, 0o7777)))
    },
    success: Schema.Number,
    error: RepoRpcError
  }),
  Rpc.make("ListFiles", {
    payload: { path: Schema.optional(Schema.String) },
    success: Schema.Array(RepoEntry),
    error: RepoRpcError
  })
) {}

/**
 * The control socket's serialization: @effect/rpc's NDJSON with lines of at most
 * MAX_CONTROL_LINE bytes. A line that is not a JSON message (an empty one included) ends the
 * connection: a flood of junk costs its reader one line, not a reply per line.
 */
export const controlSerialization: RpcSerialization.RpcSerialization["Type"] = (() => {
  const ndjson = RpcSerialization.makeNdjson({ maxBufferSize: MAX_CONTROL_LINE })
  return RpcSerialization.RpcSerialization.of({
    contentType: ndjson.contentType,
    includesFraming: ndjson.includesFraming,
    unsafeMake: () => {
      const parser = ndjson.unsafeMake()
      return {
        encode: (message) => parser.encode(message),
        decode: (bytes) => {
          let items: ReadonlyArray<unknown>
          try {
            items = parser.decode(bytes)
          } catch (cause) {
            throw new LineRefused(cause)
          }
          for (const item of items)
            if (
              typeof item !== "object" ||
              item === null ||
              typeof (item as { _tag?: unknown })._tag !== "string"
            )
              throw new LineRefused("not a message")
          return items
        }
      }
    }
  })
})()

/**
 * A line refused by `controlSerialization`. Tagged as @effect/rpc's own serialization error,
 * which is the one failure its socket server answers by closing the connection.
 */
class LineRefused {
  readonly _tag = "RpcSerializationError"
  readonly message: string
  constructor(readonly cause: unknown) {
    this.message = `not a control message: ${cause instanceof Error ? cause.message : String(cause)}`
  }
}
