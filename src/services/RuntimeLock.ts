import * as Context from "effect/Context"
import type * as Effect from "effect/Effect"
import type * as Scope from "effect/Scope"
import * as Schema from "effect/Schema"
import type { SessionLocation } from "../domain/sessionLayout.js"

export class SessionBusy extends Schema.TaggedError<SessionBusy>()("SessionBusy", {
  sessionId: Schema.String,
  message: Schema.String
}) {}

export class LockError extends Schema.TaggedError<LockError>()("LockError", {
  path: Schema.String,
  message: Schema.String
}) {}

export interface HeldLock {
  readonly sessionId: string
  readonly path: string
  /** the locked file descriptor; hand it to the VMM helper so the lock lives as long as the VM */
  readonly fd: number
  /**
   * Call once a child that must outlive this scope has inherited `fd`: the release then only
   * closes this process's fd (no unlock, which would free the shared lock for the child too),
   * so the lock lives until the last holder exits.
   */
  readonly handOff: Effect.Effect<void>
}

/**
 * One supervisor per session. `acquire` is exclusive and non-blocking (fails `SessionBusy` at
 * once), released when the scope closes and by the kernel when the process (and every child
 * that inherited the fd) dies.
 */
export interface RuntimeLockShape {
  /**
   * `session`: where the session lives, as SessionStore located it (`locate`, a `list` row), so
   * a session of the legacy home locks in its own directory; a bare id names a session of the
   * current home.
   */
  readonly acquire: (
    session: SessionLocation | string
  ) => Effect.Effect<HeldLock, SessionBusy | LockError, Scope.Scope>
}

export class RuntimeLock extends Context.Tag("abox/RuntimeLock")<RuntimeLock, RuntimeLockShape>() {}
