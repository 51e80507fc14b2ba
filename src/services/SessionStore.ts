import * as Context from "effect/Context"
import type * as Effect from "effect/Effect"
import * as Schema from "effect/Schema"
import { BrokerPolicy } from "../broker/policy.js"
import { CloseOutcome, GuestArch, ImageIdentity, RootDiskInfo, VmmBackendName } from "../domain/session.js"
import type { GuestConfig } from "../protocol/GuestConfig.js"
import type { SessionLocation } from "../domain/sessionLayout.js"

export const SESSION_FORMAT = 1

/**
 * Where a fork came from (docs/on-disk.md "Forks and frozen layers"): the parent's id (and name
 * then), when, and the parent's frozen layers the fork's overlays were made over (absolute
 * paths; `abox rm --force` of the parent later rebases the fork off them)
 */
export const ForkOrigin = Schema.Struct({
  parent: Schema.String,
  parentName: Schema.optional(Schema.String),
  at: Schema.String,
  root: Schema.String,
  repo: Schema.optional(Schema.String),
  /** the parent's state then: running, suspended (the fork got its memory) or stopped */
  from: Schema.Literal("running", "suspended", "stopped")
})
export type ForkOrigin = typeof ForkOrigin.Type

/**
 * `session.json`. `guest` and `vmm` are optional in the schema so that sessions written before
 * that metadata existed still decode, and resume can say precisely why it refuses them.
 */
export const SessionMeta = Schema.Struct({
  format: Schema.Literal(SESSION_FORMAT),
  id: Schema.String,
  created: Schema.String,
  source: Schema.String,
  name: Schema.optional(Schema.String),
  model: Schema.String,
  image: Schema.optional(ImageIdentity),
  /** the root disk's kind, format and backing image; absent: a full root.raw copy (older sessions) */
  rootDisk: Schema.optional(RootDiskInfo),
  guest: Schema.optional(Schema.Struct({ arch: GuestArch, protocol: Schema.Number })),
  vmm: Schema.optional(Schema.Struct({ backend: VmmBackendName })),
  resources: Schema.optional(Schema.Struct({ cpus: Schema.Number, memoryMiB: Schema.Number })),
  /** the HTTPS broker's policy for this session (names of credentials, never their values) */
  policy: Schema.optional(BrokerPolicy),
  /** set when macOS/arm64 backfilled the narrow legacy format on resume */
  backfilled: Schema.optional(Schema.String),
  /** short socket path used where the session dir is too long for a unix socket (macOS: 104 bytes) */
  rpcSocket: Schema.optional(Schema.String),
  lastClose: Schema.optional(CloseOutcome),
  /** a fork (`abox fork`): the session it was made from and the frozen layers its disks are over */
  fork: Schema.optional(ForkOrigin)
})
export type SessionMeta = typeof SessionMeta.Type

// ---- errors (they cross the CLI and SDK: Schema.TaggedError) ----

export class SessionNotFound extends Schema.TaggedError<SessionNotFound>()("SessionNotFound", {
  ref: Schema.String,
  message: Schema.String
}) {}

export class SessionCorrupt extends Schema.TaggedError<SessionCorrupt>()("SessionCorrupt", {
  path: Schema.String,
  reason: Schema.String,
  message: Schema.String
}) {}

export class SessionFormatTooNew extends Schema.TaggedError<SessionFormatTooNew>()("SessionFormatTooNew", {
  path: Schema.String,
  found: Schema.Number,
  supported: Schema.Number,
  message: Schema.String
}) {}

export class StoreIoError extends Schema.TaggedError<StoreIoError>()("StoreIoError", {
  path: Schema.String,
  operation: Schema.String,
  message: Schema.String
}) {}

export class NameTaken extends Schema.TaggedError<NameTaken>()("NameTaken", {
  name: Schema.String,
  sessionId: Schema.String,
  message: Schema.String
}) {}

export class InvalidName extends Schema.TaggedError<InvalidName>()("InvalidName", {
  name: Schema.String,
  message: Schema.String
}) {}

export type ReadError = SessionNotFound | SessionCorrupt | SessionFormatTooNew | StoreIoError

/** One row of `list`: a session that decodes, or one that does not (with the reason); either where it lives. */
export type SessionListing = SessionLocation &
  (
    | { readonly _tag: "Ok"; readonly meta: SessionMeta }
    | { readonly _tag: "Corrupt"; readonly error: SessionCorrupt | SessionFormatTooNew | StoreIoError }
  )

export interface NameBinding {
  readonly name: string
  readonly sessionId: string
  readonly created: string
}

export interface NewSession {
  readonly source: string
  readonly model: string
  readonly name?: string | undefined
  readonly image?: ImageIdentity | undefined
  readonly guest?: SessionMeta["guest"]
  readonly vmm?: SessionMeta["vmm"]
  readonly resources?: SessionMeta["resources"]
  readonly policy?: SessionMeta["policy"]
}

/**
 * The sessions on disk (DESIGN.md "On disk"). Reads never rewrite or delete; writes are atomic
 * and durable; `remove` is the only way a session directory is deleted, and only on request.
 */
export interface SessionStoreShape {
  /**
   * new unique id (sorts by creation time), dir 0700, session.json written atomically; with
   * `name`, the name is bound too, and a failed bind leaves neither session nor name behind
   */
  readonly create: (input: NewSession) => Effect.Effect<SessionMeta, StoreIoError | NameTaken | InvalidName>
  readonly get: (id: string) => Effect.Effect<SessionMeta, ReadError>
  /** every session in the current and the legacy home; corrupt ones are listed with the reason */
  readonly list: () => Effect.Effect<ReadonlyArray<SessionListing>, StoreIoError>
  readonly update: (
    id: string,
    f: (meta: SessionMeta) => SessionMeta
  ) => Effect.Effect<SessionMeta, ReadError>
  /** explicit removal only; also unbinds names that point at it */
  readonly remove: (id: string) => Effect.Effect<void, SessionNotFound | StoreIoError>
  /**
   * The directory of session `id`: the current home's, else the legacy home's when the session
   * lives there (a stat each call, nothing remembered). For a caller that holds only an id; one
   * that looked the session up uses the location `locate` gave it.
   */
  readonly dir: (id: string) => string
  readonly readGuestConfig: (id: string) => Effect.Effect<GuestConfig, ReadError>
  readonly writeGuestConfig: (id: string, config: GuestConfig) => Effect.Effect<void, StoreIoError>
  /**
   * an id, or a bound name → where the session lives: its directory in the current home, else
   * in the legacy one (docs/on-disk.md "Names" for the order)
   */
  readonly locate: (
    ref: string
  ) => Effect.Effect<SessionLocation, SessionNotFound | SessionCorrupt | StoreIoError>
  /** an id, or a bound name → the session id (`locate`'s id) */
  readonly resolve: (ref: string) => Effect.Effect<string, SessionNotFound | SessionCorrupt | StoreIoError>
  // names (seed 001)
  readonly bindName: (
    name: string,
    id: string
  ) => Effect.Effect<NameBinding, NameTaken | InvalidName | SessionNotFound | StoreIoError>
  readonly lookupName: (
    name: string
  ) => Effect.Effect<NameBinding, SessionNotFound | SessionCorrupt | StoreIoError>
  readonly unbindName: (name: string) => Effect.Effect<void, SessionNotFound | StoreIoError>
  readonly listNames: () => Effect.Effect<ReadonlyArray<NameBinding>, StoreIoError>
}

export class SessionStore extends Context.Tag("abox/SessionStore")<SessionStore, SessionStoreShape>() {}
