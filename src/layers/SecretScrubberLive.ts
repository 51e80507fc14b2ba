import * as Clock from "effect/Clock"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Layer from "effect/Layer"
import * as Schema from "effect/Schema"
import { createHash } from "node:crypto"
import * as nodeFs from "node:fs"
import * as path from "node:path"
import { writeFileAtomic } from "../lib/atomicFile.js"
import {
  findSecretsInBytes,
  kindsOf,
  redactBytes,
  scrubJson,
  secretRulesVersion,
  type SecretSpan
} from "../lib/secrets.js"
import {
  CONFIG_DISK_ALIGN,
  CONFIG_DISK_HEADER,
  CONFIG_DISK_LAYOUT,
  CONFIG_DISK_MAGIC,
  CONFIG_DISK_MAX_JSON,
  decodeConfigDisk,
  encodeConfigDisk
} from "../protocol/ConfigDisk.js"
import { GuestConfig } from "../protocol/GuestConfig.js"
import { AboxPaths } from "../services/AboxPaths.js"
import { type ScrubFinding, type ScrubReport, SecretScrubber } from "../services/SecretScrubber.js"
import { HOME_FILES, SESSION_FILES } from "../domain/sessionLayout.js"
import { errorMessage } from "../domain/errorMessage.js"

/**
 * The secret scrubber, run on every start over `config.raw` and `guest-config.json` of every
 * session in both homes.
 *
 * - Clean path: one synchronous pass (`scanHomes`); a file whose stat matches the clean-file
 *   record (`scrub-cache.json`, see below) is not read; any other is read once and scanned once
 *   (`findSecretsInBytes`: a prefilter regex, then the rules); a clean file is never written.
 *   test/scrub.perf.test.ts measures 1,000 clean sessions both ways.
 * - config.raw that decodes: rewritten through `encodeConfigDisk` from the decoded GuestConfig
 *   (which drops unknown fields) with secrets inside its strings redacted; fresh zero padding.
 *   One that does not decode (older layouts, foreign content): redacted in place, same length,
 *   so no offset moves; when its header and checksum were valid, the checksum is recomputed.
 * - guest-config.json that parses as JSON: secret-named fields removed at any depth, secrets
 *   inside strings redacted (same length), everything else kept in order, written the way abox
 *   writes JSON (2-space indent, trailing newline). Not JSON: redacted in place at byte level.
 * - After either route the output is scanned again; anything left is redacted at byte level, so
 *   no recognised secret survives whatever the route.
 * - Every change is one atomic replace (`writeFileAtomic`: temp file, fsync, rename, directory
 *   fsync): a crash leaves the old file or the new one. Nothing is ever deleted.
 * - `dryRun`: nothing is written; a finding lists what would change, with `changed: false`.
 *   Outside a dry run, `changed` says the file was replaced.
 */

export const SCRUBBED_FILES = [SESSION_FILES.configDisk, SESSION_FILES.guestConfig] as const

export interface FileScrub {
  /** the bytes the file should hold (the input itself when clean) */
  readonly bytes: Uint8Array
  readonly kinds: ReadonlyArray<string>
  readonly count: number
  readonly changed: boolean
}

const sameBytes = (a: Uint8Array, b: Uint8Array): boolean =>
  a.byteLength === b.byteLength && Buffer.from(a.buffer, a.byteOffset, a.byteLength).equals(b)

const clean = (bytes: Uint8Array): FileScrub => ({ bytes, kinds: [], count: 0, changed: false })

const finish = (
  original: Uint8Array,
  spans: ReadonlyArray<SecretSpan>,
  candidate: Uint8Array,
  fallback: (bytes: Uint8Array, spans: ReadonlyArray<SecretSpan>) => Uint8Array
): FileScrub => {
  const left = findSecretsInBytes(candidate)
  const bytes = left.length === 0 ? candidate : fallback(candidate, left)
  return { bytes, kinds: kindsOf(spans), count: spans.length, changed: !sameBytes(bytes, original) }
}

/** the JSON region of a config disk whose header and checksum are valid, else undefined */
const validJsonRegion = (bytes: Uint8Array): readonly [number, number] | undefined => {
  const buffer = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength)
  if (buffer.length < CONFIG_DISK_HEADER || !buffer.subarray(0, 8).equals(CONFIG_DISK_MAGIC)) return undefined
  if (buffer.readUInt32BE(8) !== CONFIG_DISK_LAYOUT) return undefined
  const length = buffer.readUInt32BE(12)
  if (length > CONFIG_DISK_MAX_JSON || CONFIG_DISK_HEADER + length > buffer.length) return undefined
  const json = buffer.subarray(CONFIG_DISK_HEADER, CONFIG_DISK_HEADER + length)
  return createHash("sha256").update(json).digest().equals(buffer.subarray(16, 48))
    ? [CONFIG_DISK_HEADER, CONFIG_DISK_HEADER + length]
    : undefined
}

/** same-length redaction of a config disk; a valid header stays valid (checksum recomputed) */
const redactConfigDisk = (bytes: Uint8Array, spans: ReadonlyArray<SecretSpan>): Uint8Array => {
  const region = validJsonRegion(bytes)
  if (region === undefined) return redactBytes(bytes, spans)
  const clipped = spans
    .map((span) => ({ ...span, start: Math.max(span.start, CONFIG_DISK_HEADER) }))
    .filter((span) => span.end > span.start)
  const out = redactBytes(bytes, clipped)
  createHash("sha256").update(out.subarray(region[0], region[1])).digest().copy(out, 16)
  return out
}

const decodeGuestConfig = Schema.decodeUnknownEither(GuestConfig)

let zeros = Buffer.alloc(0)

/**
 * Where a config disk's content ends: past the declared JSON when the rest (the sector
 * padding) is all zero bytes, which cannot hold any part of a secret; else the whole file.
 */
const contentEnd = (bytes: Uint8Array): number => {
  const buffer = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength)
  if (buffer.length < CONFIG_DISK_HEADER || !buffer.subarray(0, 8).equals(CONFIG_DISK_MAGIC))
    return buffer.length
  const end = Math.min(CONFIG_DISK_HEADER + buffer.readUInt32BE(12), buffer.length)
  const padding = buffer.length - end
  if (zeros.length < padding) zeros = Buffer.alloc(Math.max(padding, CONFIG_DISK_ALIGN))
  return buffer.compare(zeros, 0, padding, end, buffer.length) === 0 ? end : buffer.length
}

/** what a scrub does to one config.raw (pure: bytes in, bytes out) */
export const scrubConfigDisk = (bytes: Uint8Array): FileScrub => {
  const spans = findSecretsInBytes(bytes, contentEnd(bytes))
  if (spans.length === 0) return clean(bytes)
  const decoded = decodeConfigDisk(bytes)
  const rescrubbed = Either.isRight(decoded) ? decodeGuestConfig(scrubJson(decoded.right).value) : undefined
  const candidate =
    rescrubbed !== undefined && Either.isRight(rescrubbed)
      ? encodeConfigDisk(rescrubbed.right)
      : redactConfigDisk(bytes, spans)
  return finish(bytes, spans, candidate, redactConfigDisk)
}

const decodeJsonText = Schema.decodeUnknownEither(Schema.parseJson())
const utf8 = new TextDecoder("utf-8", { fatal: true })

const decodeUtf8 = (bytes: Uint8Array): string | undefined => {
  try {
    return utf8.decode(bytes)
  } catch {
    return undefined
  }
}

/** what a scrub does to one guest-config.json (pure) */
export const scrubGuestConfigJson = (bytes: Uint8Array): FileScrub => {
  const spans = findSecretsInBytes(bytes)
  if (spans.length === 0) return clean(bytes)
  const text = decodeUtf8(bytes)
  const parsed = text === undefined ? undefined : decodeJsonText(text)
  const candidate =
    parsed !== undefined && Either.isRight(parsed)
      ? Buffer.from(JSON.stringify(scrubJson(parsed.right).value, null, 2) + "\n", "utf8")
      : redactBytes(bytes, spans)
  return finish(bytes, spans, candidate, redactBytes)
}

const scrubberFor: Record<(typeof SCRUBBED_FILES)[number], (bytes: Uint8Array) => FileScrub> = {
  [SESSION_FILES.configDisk]: scrubConfigDisk,
  [SESSION_FILES.guestConfig]: scrubGuestConfigJson
}

const errorCode = (cause: unknown): string | undefined =>
  typeof cause === "object" && cause !== null && "code" in cause && typeof cause.code === "string"
    ? cause.code
    : undefined

/**
 * The clean-file record (`$ABOX_HOME/scrub-cache.json`, outside every session): file path →
 * `dev:ino:size:mtimeMs:ctimeMs` of a file that held no secret under the current rules
 * (`rules`). A file whose stat still matches is not read again. It cannot hide a secret:
 * - any write to a file moves its mtime and ctime, and ctime cannot be set from user space;
 *   a replaced file has a new inode or a new ctime; a rules change drops the whole record;
 * - timestamps tick coarsely (jiffies, or seconds on some filesystems), so a file is only
 *   recorded when its ctime is older than the scan's start by `cacheMarginMs`: a later write
 *   then necessarily carries a different ctime.
 * The record is rewritten (atomically) only when it changes, and never in a dry run. A
 * missing or undecodable record is simply empty.
 */
const ScrubCache = Schema.Struct({
  format: Schema.Literal(1),
  rules: Schema.String,
  files: Schema.Record({ key: Schema.String, value: Schema.String })
})
const decodeScrubCache = Schema.decodeUnknownEither(Schema.parseJson(ScrubCache))

export const SCRUB_CACHE_FILE = HOME_FILES.scrubCache

const statKey = (stat: nodeFs.Stats): string =>
  `${stat.dev}:${stat.ino}:${stat.size}:${stat.mtimeMs}:${stat.ctimeMs}`

const readCache = (file: string, rules: string): ReadonlyMap<string, string> => {
  let text: string
  try {
    text = nodeFs.readFileSync(file, "utf8")
  } catch {
    return new Map()
  }
  const decoded = decodeScrubCache(text)
  return Either.isRight(decoded) && decoded.right.rules === rules
    ? new Map(Object.entries(decoded.right.files))
    : new Map()
}

const sameEntries = (a: ReadonlyMap<string, string>, b: ReadonlyMap<string, string>): boolean =>
  a.size === b.size && [...a].every(([key, value]) => b.get(key) === value)

interface DirtyFile {
  readonly file: string
  readonly sessionId: string
  readonly legacy: boolean
  readonly result: FileScrub
}

interface Scan {
  readonly sessionsScanned: number
  readonly filesScanned: number
  readonly dirty: ReadonlyArray<DirtyFile>
  readonly problems: ReadonlyArray<{ readonly path: string; readonly reason: string }>
  /** files found clean now, for the next start's record */
  readonly clean: ReadonlyMap<string, string>
}

const isDirectory = (home: string, entry: nodeFs.Dirent): boolean => {
  if (entry.isDirectory()) return true
  if (!entry.isSymbolicLink()) return false
  const target = nodeFs.statSync(path.join(home, entry.name), { throwIfNoEntry: false })
  return target?.isDirectory() ?? false
}

/**
 * The read-only pass over every session file. Plain synchronous node:fs on purpose: it runs on
 * every start over ~2,000 small files, where sync stat/read (no thread-pool round trip) and a
 * plain loop (no per-file effect) were measured several times faster than @effect/platform's
 * FileSystem. Every failure becomes a problem; nothing here writes.
 */
const scanHomes = (
  homes: ReadonlyArray<{ readonly home: string; readonly legacy: boolean }>,
  known: ReadonlyMap<string, string>,
  recordableBeforeMs: number
): Scan => {
  const dirty: Array<DirtyFile> = []
  const problems: Array<{ path: string; reason: string }> = []
  const clean = new Map<string, string>()
  let sessionsScanned = 0
  let filesScanned = 0
  for (const { home, legacy } of homes) {
    let entries: Array<nodeFs.Dirent>
    try {
      entries = nodeFs.readdirSync(home, { withFileTypes: true })
    } catch (cause) {
      // an absent home (the legacy one, usually) is simply empty
      if (errorCode(cause) !== "ENOENT") problems.push({ path: home, reason: errorMessage(cause) })
      continue
    }
    const sessionIds = entries
      .filter((entry) => !entry.name.startsWith(".") && isDirectory(home, entry))
      .map((entry) => entry.name)
      .sort()
    for (const sessionId of sessionIds) {
      sessionsScanned++
      for (const name of SCRUBBED_FILES) {
        const file = path.join(home, sessionId, name)
        try {
          const stat = nodeFs.statSync(file, { throwIfNoEntry: false })
          // a session without this file is fine
          if (stat === undefined) continue
          filesScanned++
          const key = statKey(stat)
          if (known.get(file) === key) {
            clean.set(file, key)
            continue
          }
          const result = scrubberFor[name](nodeFs.readFileSync(file))
          if (result.count > 0 || result.changed) dirty.push({ file, sessionId, legacy, result })
          else if (stat.ctimeMs <= recordableBeforeMs) clean.set(file, key)
        } catch (cause) {
          if (errorCode(cause) !== "ENOENT") problems.push({ path: file, reason: errorMessage(cause) })
        }
      }
    }
  }
  return { sessionsScanned, filesScanned, dirty, problems, clean }
}

export interface SecretScrubberOptions {
  /** how much older than the scan a file's ctime must be to be recorded clean (tests use 0) */
  readonly cacheMarginMs?: number
}

export const makeSecretScrubberLive = (options: SecretScrubberOptions = {}) =>
  Layer.effect(
    SecretScrubber,
    Effect.gen(function* () {
      const paths = yield* AboxPaths
      const cacheMarginMs = options.cacheMarginMs ?? 2000
      const rules = secretRulesVersion()
      const cacheFile = path.join(paths.home, SCRUB_CACHE_FILE)
      const homes = [{ home: paths.sessions, legacy: false }]
      if (path.resolve(paths.legacySessions) !== path.resolve(paths.sessions)) {
        homes.push({ home: paths.legacySessions, legacy: true })
      }

      const scrub = Effect.fn("SecretScrubber.scrub")(function* (options: { readonly dryRun: boolean }) {
        // compared with the files' ctimes: in production the Clock is the wall clock
        const startedMs = yield* Clock.currentTimeMillis
        const known = readCache(cacheFile, rules)
        const scan = yield* Effect.sync(() => scanHomes(homes, known, startedMs - cacheMarginMs))
        const findings: Array<ScrubFinding> = []
        const problems = [...scan.problems]

        // only dirty files get here: each is one atomic replace, or a problem
        yield* Effect.forEach(
          scan.dirty,
          ({ file, sessionId, legacy, result }) => {
            const finding = { path: file, sessionId, legacy, kinds: result.kinds, count: result.count }
            return options.dryRun || !result.changed
              ? Effect.sync(() => findings.push({ ...finding, changed: false }))
              : writeFileAtomic(file, result.bytes, 0o600).pipe(
                  Effect.matchEffect({
                    onFailure: (error) =>
                      Effect.sync(() => {
                        findings.push({ ...finding, changed: false })
                        problems.push({ path: file, reason: `cannot replace: ${error.message}` })
                      }),
                    onSuccess: () => Effect.sync(() => findings.push({ ...finding, changed: true }))
                  })
                )
          },
          { discard: true }
        )

        if (!options.dryRun && !sameEntries(scan.clean, known) && nodeFs.existsSync(paths.home)) {
          const record = { format: 1 as const, rules, files: Object.fromEntries(scan.clean) }
          // only a speed-up: failing to write it changes nothing the scrub promises
          yield* writeFileAtomic(cacheFile, Buffer.from(JSON.stringify(record) + "\n", "utf8"), 0o600).pipe(
            Effect.ignore
          )
        }

        const byPath = (a: { readonly path: string }, b: { readonly path: string }) =>
          a.path.localeCompare(b.path)
        const report: ScrubReport = {
          dryRun: options.dryRun,
          sessionsScanned: scan.sessionsScanned,
          filesScanned: scan.filesScanned,
          findings: findings.sort(byPath),
          problems: problems.sort(byPath)
        }
        return report
      })

      return SecretScrubber.of({ scrub })
    })
  )

export const SecretScrubberLive = makeSecretScrubberLive()
