import * as Context from "effect/Context"
import type * as Effect from "effect/Effect"
import * as Schema from "effect/Schema"
import type * as Scope from "effect/Scope"
import type * as Stream from "effect/Stream"
import type { BrokerPolicy } from "../broker/policy.js"
import type { TunnelRequest } from "./GuestRpc.js"

/** The policy file is missing, unreadable or does not decode (its path and the reason). */
export class BrokerPolicyError extends Schema.TaggedError<BrokerPolicyError>()("BrokerPolicyError", {
  path: Schema.String,
  reason: Schema.String,
  message: Schema.String
}) {}

/** The broker could not start for a session (CA generation, broker.log). */
export class BrokerError extends Schema.TaggedError<BrokerError>()("BrokerError", {
  reason: Schema.String,
  message: Schema.String
}) {}

/** One tunnel could not be served (the broker's fault, not the guest's): logged, ends that tunnel only. */
export class TunnelFailed extends Schema.TaggedError<TunnelFailed>()("TunnelFailed", {
  reason: Schema.String,
  message: Schema.String
}) {}

export interface BrokerSessionInfo {
  readonly sessionId: string
  /** broker.log is written here */
  readonly sessionDir: string
}

/** One session's broker: lives as long as the scope it was made in (the session's). */
export interface BrokerSession {
  /** PEM of the per-session CA certificate (public): `GuestConfig.brokerCaCert` */
  readonly caCertPem: string
  /** the policy's `guestCaFiles`, read and checked at make: certificates only (`GuestConfig.extraCaCerts`) */
  readonly guestCaPems: ReadonlyArray<string>
  /** `<sessionDir>/broker.log` (JSON lines, 0600) */
  readonly logPath: string
  /** decide and serve every request of the stream (`connection.tunnels`); fork it in the session scope */
  readonly serve: (tunnels: Stream.Stream<TunnelRequest>) => Effect.Effect<void>
  /** decide and serve one request; returns when the tunnel is closed or denied */
  readonly handle: (request: TunnelRequest) => Effect.Effect<void>
  /** the turn now running (logged with each decision), or undefined between turns */
  readonly setTurn: (turn: number | undefined) => Effect.Effect<void>
  /** tunnels being served now */
  readonly active: Effect.Effect<number>
}

export interface HttpsBrokerShape {
  readonly make: (
    policy: BrokerPolicy,
    session: BrokerSessionInfo
  ) => Effect.Effect<BrokerSession, BrokerError, Scope.Scope>
  /** read and decode a policy file (docs/broker.md) */
  readonly loadPolicy: (path: string) => Effect.Effect<BrokerPolicy, BrokerPolicyError>
}

export class HttpsBroker extends Context.Tag("abox/HttpsBroker")<HttpsBroker, HttpsBrokerShape>() {}
