/**
 * Archives from the guest, written on the host. The guest is an attacker here: its tar goes
 * through the same checked extractor as the host's snapshots in the guest
 * (src/guest/extract.ts: no absolute path, no `..`, nothing written through a link, files
 * created with O_EXCL|O_NOFOLLOW, permission bits only), plus the host's own rules: devices,
 * FIFOs and other special entries are refused, the total size and the entry count are bounded
 * (from each header, before a byte is written) and, for `abox cp`, a symlink must point inside
 * the copied tree. The target is a fresh directory the caller owns; nothing is written outside it.
 */
import * as Effect from "effect/Effect"
import * as Ref from "effect/Ref"
import * as Stream from "effect/Stream"
import { ExtractError, extractTar } from "../guest/extract.js"
import { ArchiveRefused } from "../domain/repoErrors.js"
import { escapeControl } from "./text.js"
import { errorMessage } from "../domain/errorMessage.js"

export interface UntrustedLimits {
  /** file bytes in all */
  readonly maxBytes: number
  readonly maxEntries: number
  /** refuse symlinks that point outside the tree (absolute, or above its root) */
  readonly linksInside: boolean
}

export const DEFAULT_LIMITS: UntrustedLimits = {
  maxBytes: 8 * 1024 * 1024 * 1024,
  maxEntries: 2_000_000,
  linksInside: false
}

export const extractUntrusted = <E>(
  archive: Stream.Stream<Uint8Array, E>,
  target: string,
  limits: UntrustedLimits = DEFAULT_LIMITS
): Effect.Effect<{ readonly files: number; readonly bytes: number }, E | ArchiveRefused> =>
  Effect.gen(function* () {
    const streamError = yield* Ref.make<ReadonlyArray<E>>([])
    const source = archive.pipe(Stream.tapError((error) => Ref.set(streamError, [error])))
    return yield* Effect.tryPromise({
      try: () => extractTar(Stream.toAsyncIterable(source), target, { untrusted: limits }),
      catch: (cause) => cause
    }).pipe(
      Effect.catchAll((cause) =>
        Effect.flatMap(Ref.get(streamError), (errors): Effect.Effect<never, E | ArchiveRefused> =>
          errors.length > 0
            ? Effect.fail(errors[0]!)
            : Effect.fail(
                // the reason quotes names the guest chose: printable only
                new ArchiveRefused({
                  reason: escapeControl(cause instanceof ExtractError ? cause.reason : String(cause)),
                  message: `the guest's archive was refused: ${escapeControl(errorMessage(cause))}`
                })
              )
        )
      ),
      Effect.map((result) => ({ files: result.files, bytes: result.bytes }))
    )
  })
