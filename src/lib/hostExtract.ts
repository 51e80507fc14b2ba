/**
 * Archives from the guest, written on the host. The guest is an attacker here: its tar goes
 * through the same checked extractor as the host's snapshots in the guest
 * (src/guest/extract.ts: no absolute path, no `..`, nothing written through a link, files
 * created with O_EXCL|O_NOFOLLOW, permission bits only), plus the host's own rules: devices,
 * FIFOs and other special entries are refused; the total size, one file's size and the entry
 * count are bounded (from each header, before a byte of it is read); for `abox cp` a symlink
 * must point inside what was copied and a `.git` is left in the guest. A refusal, the caller's
 * interruption (a client gone) or a guest silent for EXPORT_IDLE_TIMEOUT ends the guest's
 * stream at once (its channel is closed: the guest stops its tar), never drained to its end.
 * The target is a fresh directory the caller owns; nothing is written outside it.
 */
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Ref from "effect/Ref"
import * as Stream from "effect/Stream"
import { ExtractError, extractTar, type UntrustedRules } from "../guest/extract.js"
import { ArchiveRefused } from "../domain/repoErrors.js"
import { escapeControl } from "./text.js"
import { errorMessage } from "../domain/errorMessage.js"

export type UntrustedLimits = UntrustedRules

const GiB = 1024 * 1024 * 1024
const MiB = 1024 * 1024

/** `abox cp` and the SDK's files: what lands in the user's chosen directory */
export const DEFAULT_LIMITS: UntrustedLimits = {
  maxBytes: 8 * GiB,
  maxEntries: 2_000_000
}

/**
 * `abox diff` / `apply`: both trees are held in a host temporary directory and hashed by host
 * git, and the patch (binary files base85, ~1.25× their size) is held in memory: one file of
 * at most 64 MiB, 1 GiB in all (docs/exit-codes.md, "limits").
 */
export const DIFF_LIMITS: UntrustedLimits = {
  maxBytes: 1 * GiB,
  maxFileBytes: 64 * MiB,
  maxEntries: 1_000_000
}

/** how long the guest may send nothing before its archive is refused */
export const EXPORT_IDLE_TIMEOUT = Duration.minutes(5)

/** the stream's failure that says the guest sent nothing for too long */
class Idle {
  readonly _tag = "Idle"
}

export const extractUntrusted = <E>(
  archive: Stream.Stream<Uint8Array, E>,
  target: string,
  limits: UntrustedLimits = DEFAULT_LIMITS,
  idleTimeout: Duration.DurationInput = EXPORT_IDLE_TIMEOUT
): Effect.Effect<{ readonly files: number; readonly bytes: number; readonly skipped: number }, E | ArchiveRefused> =>
  Effect.gen(function* () {
    const streamError = yield* Ref.make<ReadonlyArray<E | Idle>>([])
    const source = archive.pipe(
      Stream.timeoutFail(() => new Idle(), idleTimeout),
      Stream.tapError((error) => Ref.set(streamError, [error]))
    )
    const runtime = yield* Effect.runtime<never>()
    // interrupted (a client gone): the extraction is stopped and awaited, so that nothing is
    // written into the target once this has returned
    const extracted = Effect.async<Awaited<ReturnType<typeof extractTar>>, unknown>((resume) => {
      const controller = new AbortController()
      const done = extractTar(Stream.toAsyncIterableRuntime(source, runtime), target, {
        untrusted: limits,
        signal: controller.signal
      })
      done.then(
        (result) => resume(Effect.succeed(result)),
        (cause: unknown) => resume(Effect.fail(cause))
      )
      return Effect.promise(() => {
        controller.abort()
        return done.catch(() => undefined)
      })
    })
    return yield* extracted.pipe(
      Effect.catchAll((cause) =>
        Effect.flatMap(Ref.get(streamError), (errors): Effect.Effect<never, E | ArchiveRefused> => {
          const first = errors[0]
          if (first instanceof Idle) {
            return Effect.fail(
              new ArchiveRefused({
                reason: "idle",
                message: `the guest's archive was refused: it sent nothing for ${Duration.format(idleTimeout)}`
              })
            )
          }
          return errors.length > 0
            ? Effect.fail(first as E)
            : Effect.fail(
                // the reason quotes names the guest chose: printable only
                new ArchiveRefused({
                  reason: escapeControl(cause instanceof ExtractError ? cause.reason : String(cause)),
                  message: `the guest's archive was refused: ${escapeControl(errorMessage(cause))}`
                })
              )
        })
      ),
      Effect.map((result) => ({ files: result.files, bytes: result.bytes, skipped: result.skipped }))
    )
  })
