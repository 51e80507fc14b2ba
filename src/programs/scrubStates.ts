/**
 * `abox scrub` over suspended sessions' memory states (`memory.state`, docs/on-disk.md "State
 * files"): each state is read as a stream — through `zstd -dc` when its manifest says zstd — and
 * scanned with the scrubber's rules (src/lib/secrets.ts).
 *
 * Findings are reported, never redacted: a state is the guest's RAM, whose page cache holds the
 * repository's own files. Overwriting bytes there would change those files as the guest sees
 * them (and may write them back), so a scrub would lose the user's data. abox puts no credential
 * in a guest (test/e2e-suspend-vm.test.ts plants a canary); a secret found in a state came from
 * the session's own work, and the user decides (`abox rm`, or resume it and remove it there).
 * A secret that straddles two guest pages is not contiguous in the stream and is not seen.
 */
import * as Command from "@effect/platform/Command"
import type { CommandExecutor } from "@effect/platform/CommandExecutor"
import type { PlatformError } from "@effect/platform/Error"
import * as FileSystem from "@effect/platform/FileSystem"
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
// Raw node:fs: one directory listing and existence checks, as the start-up scrubber does.
import * as nodeFs from "node:fs"
import * as path from "node:path"
import { errorMessage } from "../domain/errorMessage.js"
import { findSecretsInBytes } from "../lib/secrets.js"
import { readManifest } from "../vmm/migration.js"
import { AboxPaths } from "../services/AboxPaths.js"
import type { ScrubFinding } from "../services/SecretScrubber.js"
import { savedStateFiles } from "./suspend.js"

/** bytes kept from one chunk to the next, so a secret cut by a chunk's end is found whole */
const OVERLAP = 4096

export interface StateScan {
  readonly count: number
  readonly kinds: ReadonlyArray<string>
}

/** scans a byte stream for secrets, each counted once however the chunks cut it */
export const scanStream = <E, R>(bytes: Stream.Stream<Uint8Array, E, R>): Effect.Effect<StateScan, E, R> =>
  Effect.suspend(() => {
    let tail = Buffer.alloc(0)
    // the stream offset of tail[0]
    let base = 0
    // where the secrets found in the kept tail start: they are found again with the next chunk
    let seen = new Set<number>()
    let count = 0
    const kinds = new Set<string>()
    const take = (chunk: Uint8Array) => {
      const buffer = Buffer.concat([tail, chunk])
      for (const span of findSecretsInBytes(buffer)) {
        const at = base + span.start
        if (seen.has(at)) continue
        seen.add(at)
        count++
        kinds.add(span.kind)
      }
      const keep = Math.min(OVERLAP, buffer.length)
      base += buffer.length - keep
      seen = new Set([...seen].filter((at) => at >= base))
      tail = Buffer.from(buffer.subarray(buffer.length - keep))
    }
    return Stream.runForEachChunk(bytes, (chunk) =>
      Effect.sync(() => {
        for (const piece of chunk) take(piece)
      })
    ).pipe(Effect.map(() => ({ count, kinds: [...kinds].sort() })))
  })

const stateBytes = (
  file: string,
  compression: "zstd" | "raw"
): Effect.Effect<StateScan, PlatformError | Error, FileSystem.FileSystem | CommandExecutor> =>
  compression === "raw"
    ? Effect.flatMap(FileSystem.FileSystem, (fs) => scanStream(fs.stream(file, { chunkSize: 1024 * 1024 })))
    : Effect.scoped(
        Effect.gen(function* () {
          const zstd = yield* Command.start(Command.make("zstd", "-dc", "--", file))
          const scan = yield* scanStream(zstd.stdout)
          const code = yield* zstd.exitCode
          if (code !== 0) return yield* Effect.fail(new Error(`zstd -dc exited with ${code}`))
          return scan
        })
      )

export interface StatesReport {
  readonly statesScanned: number
  readonly findings: ReadonlyArray<ScrubFinding>
  readonly problems: ReadonlyArray<{ readonly path: string; readonly reason: string }>
}

/** every session's memory state in the home, scanned; nothing is written */
export const scanMemoryStates = Effect.fn("scrub.memoryStates")(function* () {
  const paths = yield* AboxPaths
  const findings: Array<ScrubFinding> = []
  const problems: Array<{ path: string; reason: string }> = []
  let statesScanned = 0
  const sessions = yield* Effect.sync(() => {
    try {
      return nodeFs.readdirSync(paths.sessions).filter((name) => !name.startsWith("."))
    } catch {
      return [] as Array<string>
    }
  })
  for (const sessionId of sessions.sort()) {
    const files = savedStateFiles(path.join(paths.sessions, sessionId))
    if (!nodeFs.existsSync(files.manifest) || !nodeFs.existsSync(files.state)) continue
    statesScanned++
    const scanned = yield* readManifest(files.manifest).pipe(
      Effect.flatMap((manifest) => stateBytes(files.state, manifest.compression)),
      Effect.either
    )
    if (scanned._tag === "Left") {
      problems.push({ path: files.state, reason: errorMessage(scanned.left).split("\n")[0] ?? "" })
      continue
    }
    if (scanned.right.count > 0) {
      findings.push({
        path: files.state,
        sessionId,
        legacy: false,
        kinds: scanned.right.kinds,
        count: scanned.right.count,
        changed: false
      })
    }
  }
  return { statesScanned, findings, problems } satisfies StatesReport
})
