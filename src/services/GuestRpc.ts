import * as Context from "effect/Context"
import type { GuestConfig } from "../protocol/GuestConfig.js"
import type * as Duration from "effect/Duration"
import type * as Effect from "effect/Effect"
import type * as Scope from "effect/Scope"
import * as Schema from "effect/Schema"
import type * as Stream from "effect/Stream"
import type { TransferFailed } from "../domain/transfer.js"
import type { AgentEvent, HelloMessage, TurnLimits, TurnSignalName } from "../protocol/Messages.js"

export class GuestTooOld extends Schema.TaggedError<GuestTooOld>()("GuestTooOld", {
  protocol: Schema.Number,
  minimum: Schema.Number,
  message: Schema.String
}) {}

export class GuestTooNew extends Schema.TaggedError<GuestTooNew>()("GuestTooNew", {
  protocol: Schema.Number,
  maximum: Schema.Number,
  message: Schema.String
}) {}

/** the guest sent something that is not protocol v4 (bad frame, bad JSON, unknown type, too big) */
export class ProtocolError extends Schema.TaggedError<ProtocolError>()("ProtocolError", {
  reason: Schema.String,
  message: Schema.String
}) {}

export class GuestTimeout extends Schema.TaggedError<GuestTimeout>()("GuestTimeout", {
  waitingFor: Schema.String,
  message: Schema.String
}) {}

/** the connection ended (VM died, socket closed) */
export class GuestDisconnected extends Schema.TaggedError<GuestDisconnected>()("GuestDisconnected", {
  message: Schema.String
}) {}

/** the guest could not connect a port forward to 127.0.0.1:<port> in the guest */
export class ForwardRefused extends Schema.TaggedError<ForwardRefused>()("ForwardRefused", {
  port: Schema.Number,
  message: Schema.String
}) {}

/** the session's guest has no tty turns (its image predates them: hello.features lacks "tty") */
export class TtyUnsupported extends Schema.TaggedError<TtyUnsupported>()("TtyUnsupported", {
  message: Schema.String
}) {}

/** what a client's terminal sends during a tty turn */
export type TtyControl =
  | { readonly _tag: "Input"; readonly bytes: Uint8Array }
  | { readonly _tag: "Resize"; readonly rows: number; readonly cols: number }
  | { readonly _tag: "Signal"; readonly signal: typeof TurnSignalName.Type }

export interface TtyRequest {
  readonly rows: number
  readonly cols: number
  /** the client's TERM */
  readonly term?: string | undefined
  /** typed bytes, resizes and signals, sent to the guest as they come while the turn runs */
  readonly controls: Stream.Stream<TtyControl>
}

/** a port forward's byte stream (a protocol channel to 127.0.0.1:<port> in the guest) */
export interface ForwardChannel {
  readonly read: Stream.Stream<Uint8Array, GuestDisconnected>
  readonly write: (chunk: Uint8Array) => Effect.Effect<void, GuestDisconnected>
  /** no more bytes from this side (the guest's socket gets an EOF) */
  readonly end: Effect.Effect<void, GuestDisconnected>
}

export type GuestRpcError = GuestTooOld | GuestTooNew | ProtocolError | GuestTimeout | GuestDisconnected

export interface TurnResult {
  readonly exitCode: number | null
  readonly signal: string | null
  readonly cancelled: boolean
}

/** One event of a turn as the SDK and CLI see it: the guest's events, then the end. */
export type TurnEvent =
  | {
      readonly _tag: "Event"
      readonly event: AgentEvent
      /**
       * stdout and stderr events: exactly the bytes the turn wrote (`event.data` is their text,
       * lossy when they are not UTF-8). Absent on other kinds.
       */
      readonly bytes?: Uint8Array
    }
  | ({ readonly _tag: "End" } & TurnResult)

/**
 * An `agent_event` as a TurnEvent: stdout and stderr get their exact bytes back (`base64` when the
 * event carries it, else `data` in UTF-8, which is exact then: docs/protocol.md). The one rebuild
 * of a turn's bytes from an event on a wire (the guest's, or a supervisor's control socket).
 */
export const agentTurnEvent = (event: AgentEvent): TurnEvent => {
  if (event.kind !== "stdout" && event.kind !== "stderr") return { _tag: "Event", event }
  const bytes =
    event.base64 !== undefined ? Buffer.from(event.base64, "base64") : Buffer.from(event.data, "utf8")
  return { _tag: "Event", event, bytes: new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.length) }
}

/** A tunnel the guest asked for (broker): the host accepts or denies, then bytes flow. */
export interface TunnelRequest {
  readonly channel: number
  readonly host: string
  readonly port: number
  readonly accept: () => Effect.Effect<
    {
      readonly read: Stream.Stream<Uint8Array, GuestDisconnected>
      readonly write: (chunk: Uint8Array) => Effect.Effect<void, GuestDisconnected>
      readonly close: Effect.Effect<void>
    },
    GuestDisconnected
  >
  readonly deny: (reason: string) => Effect.Effect<void>
}

export interface GuestConnection {
  readonly hello: HelloMessage
  /** stream a tar of the snapshot into the guest's target directory (/work/repo) */
  readonly transfer: (
    tar: Stream.Stream<Uint8Array, TransferFailed>,
    target: string,
    options?: TransferOptions
  ) => Effect.Effect<{ readonly files: number; readonly bytes: number }, TransferFailed | GuestRpcError>
  /**
   * a tar of `paths` of the repository (or of the baseline recorded at Open) from the guest:
   * the guest's bytes as they come (untrusted: check every entry, src/lib/hostExtract.ts); the
   * stream fails unless the guest ends it with `transfer_end`
   */
  readonly exportTree: (request: ExportRequest) => Stream.Stream<Uint8Array, TransferFailed | GuestRpcError>
  /**
   * one turn: its events as they come, ending with `End`; interrupting the stream cancels the
   * turn. `limits` (a prompt turn's max steps and cost) go only to a guest listing FEATURE_LIMITS
   */
  readonly turn: (
    text: string,
    mode?: "shell" | "prompt",
    limits?: TurnLimits
  ) => Stream.Stream<TurnEvent, GuestRpcError>
  /**
   * one shell command on a pseudo-terminal in the guest (protocol `tty_turn`): its output is
   * `stdout` events (the terminal's bytes), then `End`; `request.controls` is read while it runs.
   * Interrupting the stream cancels the turn, as for `turn`.
   */
  readonly ttyTurn: (
    text: string,
    request: TtyRequest
  ) => Stream.Stream<TurnEvent, TtyUnsupported | GuestRpcError>
  readonly cancel: (turn: number) => Effect.Effect<void, GuestRpcError>
  /** ask the guest to sync and power off; waits (bounded) for its acknowledgement or disconnect */
  readonly shutdown: Effect.Effect<void, GuestRpcError>
  /** tunnels the guest opens (broker); each must be accepted or denied */
  readonly tunnels: Stream.Stream<TunnelRequest>
  /** a byte stream to 127.0.0.1:<port> in the guest (protocol `forward_open`); closed with the scope */
  readonly forward: (
    port: number
  ) => Effect.Effect<ForwardChannel, ForwardRefused | GuestRpcError, Scope.Scope>
}

export interface TransferOptions {
  /** Open's snapshot: the guest keeps a copy of it as the baseline of `abox diff` */
  readonly baseline?: boolean | undefined
}

export interface ExportRequest {
  readonly tree: "repo" | "baseline"
  /** relative to the tree's root; empty: the whole tree */
  readonly paths: ReadonlyArray<string>
  /** top-level names left out when `paths` is empty */
  readonly exclude?: ReadonlyArray<string> | undefined
  /** only what differs between the repository and the baseline (for a diff) */
  readonly changed?: boolean | undefined
}

export interface ResumeOptions {
  /** a fork's own broker CA (PEM), which the guest trusts from then on instead of its parent's */
  readonly brokerCaCert?: string | undefined
}

export interface GuestRpcOptions {
  readonly helloTimeout: Duration.DurationInput
  readonly shutdownTimeout: Duration.DurationInput
  /** after the tar's EOF, the bound on the wait for `transfer_end` (default 5 minutes) */
  readonly transferEndTimeout?: Duration.DurationInput
  /**
   * warm open (docs/protocol.md "Warm open"): the guest was restored from a warm snapshot and
   * waits; the connection's first message is `session` with this config, the host's clock and
   * fresh entropy (each connection its own), before the hello is awaited
   */
  readonly handoff?:
    | {
        readonly config: GuestConfig
        /** the repository disks were hot-plugged: the guest waits for them and mounts them */
        readonly repoDisks?: boolean | undefined
      }
    | undefined
}

/**
 * The host side of protocol v4. `listen` binds the session's rpc.sock (before the VM starts:
 * the VMM connects to it); `accept` waits for the guest's connection and hello, checks the
 * version, and returns a scoped connection whose finalizer sends `shutdown` (Close's first step).
 */
export interface GuestRpcShape {
  readonly listen: (
    socketPath: string,
    options: GuestRpcOptions
  ) => Effect.Effect<
    {
      readonly accept: Effect.Effect<GuestConnection, GuestRpcError, Scope.Scope>
      /**
       * the connection of a VM restored from its saved memory: the host speaks first (`resumed`:
       * the time, fresh entropy, a fork's CA) and the guest answers with hello and ready
       */
      readonly acceptResumed: (
        options: ResumeOptions
      ) => Effect.Effect<GuestConnection, GuestRpcError, Scope.Scope>
    },
    GuestDisconnected,
    Scope.Scope
  >
}

export class GuestRpc extends Context.Tag("abox/GuestRpc")<GuestRpc, GuestRpcShape>() {}
