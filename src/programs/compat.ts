import * as Either from "effect/Either"
import * as Schema from "effect/Schema"
import { MIN_GUEST_PROTOCOL, PROTOCOL_VERSION } from "../protocol/Messages.js"
import { GuestTooOld } from "../services/GuestRpc.js"
import type { GuestArch, VmmBackendName } from "../domain/session.js"
import type { SessionMeta } from "../services/SessionStore.js"

/** This host, as resume compares it with what a session recorded. */
export interface HostProfile {
  readonly os: NodeJS.Platform
  readonly arch: GuestArch
  readonly backend: VmmBackendName
}

export class SessionIncompatible extends Schema.TaggedError<SessionIncompatible>()("SessionIncompatible", {
  sessionId: Schema.String,
  field: Schema.String,
  recorded: Schema.String,
  host: Schema.String,
  message: Schema.String
}) {}

/** The narrow legacy format: arm64 + Virtualization.framework was the only runnable combination. */
const LEGACY_BACKFILL = { arch: "aarch64", backend: "vz" } as const

export interface CompatOk {
  readonly guest: NonNullable<SessionMeta["guest"]>
  readonly vmm: NonNullable<SessionMeta["vmm"]>
  /** set when the legacy format was backfilled (macOS/arm64 only) */
  readonly backfilled: boolean
}

const tooOld = (protocol: number) =>
  new GuestTooOld({
    protocol,
    minimum: MIN_GUEST_PROTOCOL,
    message: `this session's guest speaks protocol ${protocol}, this abox needs ${MIN_GUEST_PROTOCOL}+: run image-update, then open a new session`
  })

/**
 * Resume's check, before anything is booted or rewritten: the recorded guest architecture,
 * protocol and VMM backend must match this host. Linux rejects sessions that predate that
 * metadata; macOS/arm64 backfills the narrow legacy format (seed 000).
 */
export const checkCompatibility = (
  meta: SessionMeta,
  host: HostProfile
): Either.Either<CompatOk, SessionIncompatible | GuestTooOld> => {
  const incompatible = (field: string, recorded: string, hostValue: string, message: string) =>
    Either.left(new SessionIncompatible({ sessionId: meta.id, field, recorded, host: hostValue, message }))

  if (meta.guest === undefined || meta.vmm === undefined) {
    if (
      host.os === "darwin" &&
      host.arch === LEGACY_BACKFILL.arch &&
      host.backend === LEGACY_BACKFILL.backend
    ) {
      // protocol unknown: the guest's hello decides (GuestTooOld if it predates v4)
      return Either.right({
        guest: meta.guest ?? { arch: LEGACY_BACKFILL.arch, protocol: PROTOCOL_VERSION },
        vmm: meta.vmm ?? { backend: LEGACY_BACKFILL.backend },
        backfilled: true
      })
    }
    return incompatible(
      "metadata",
      "none",
      `${host.os}/${host.arch}/${host.backend}`,
      `session ${meta.id} predates guest architecture/protocol/backend metadata; it cannot be resumed on ${host.os}: open a new session`
    )
  }
  if (meta.guest.arch !== host.arch) {
    return incompatible(
      "guest.arch",
      meta.guest.arch,
      host.arch,
      `session ${meta.id} has a ${meta.guest.arch} guest; this host runs ${host.arch} guests`
    )
  }
  if (meta.vmm.backend !== host.backend) {
    return incompatible(
      "vmm.backend",
      meta.vmm.backend,
      host.backend,
      `session ${meta.id} was created with the ${meta.vmm.backend} backend; this host uses ${host.backend}`
    )
  }
  if (meta.guest.protocol < MIN_GUEST_PROTOCOL) return Either.left(tooOld(meta.guest.protocol))
  return Either.right({ guest: meta.guest, vmm: meta.vmm, backfilled: false })
}
