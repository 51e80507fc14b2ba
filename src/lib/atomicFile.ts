import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as ParseResult from "effect/ParseResult"
import * as Schema from "effect/Schema"
import * as crypto from "node:crypto"
// Raw node:fs: the durable-write protocol needs an fsync of the *directory* after the rename
// and link(2) for no-clobber creation; @effect/platform's FileSystem exposes neither.
import * as fs from "node:fs/promises"
import * as path from "node:path"
import { errorMessage } from "../domain/errorMessage.js"

/**
 * The one way abox writes a file it owns (session.json, guest-config.json, config.raw,
 * names/*.json, image.json):
 *
 *   1. create `.<base>.tmp-<random>` in the same directory (O_EXCL, final mode)
 *   2. write all bytes, fsync the file
 *   3. rename over the target (or link(2) it, for no-clobber creation)
 *   4. fsync the directory, so that the rename itself survives a crash
 *
 * A reader sees the old file or the new one, never a mix; a crash leaves at most a temp file
 * whose name starts with a dot (readers skip those).
 */
export class AtomicWriteError extends Data.TaggedError("AtomicWriteError")<{
  readonly path: string
  readonly operation: string
  readonly reason: string
  readonly cause?: unknown
}> {
  override get message() {
    return `${this.operation} ${this.path}: ${this.reason}`
  }
}

/** the target exists already (writeFileExclusive) */
export class AlreadyExists extends Data.TaggedError("AlreadyExists")<{ readonly path: string }> {}

const errorCode = (cause: unknown): string | undefined =>
  typeof cause === "object" && cause !== null && "code" in cause && typeof cause.code === "string"
    ? cause.code
    : undefined

const ioStep = <A>(file: string, operation: string, run: () => Promise<A>) =>
  Effect.tryPromise({
    try: run,
    catch: (cause) => new AtomicWriteError({ path: file, operation, reason: errorMessage(cause), cause })
  })

export const tempPathFor = (file: string): string =>
  path.join(path.dirname(file), `.${path.basename(file)}.tmp-${crypto.randomBytes(6).toString("hex")}`)

/** fsync a directory so that a rename/link/unlink inside it is durable */
export const fsyncDir = (dir: string): Effect.Effect<void, AtomicWriteError> =>
  Effect.acquireUseRelease(
    ioStep(dir, "open directory", () => fs.open(dir, "r")),
    (handle) => ioStep(dir, "fsync directory", () => handle.sync()),
    (handle) => Effect.promise(() => handle.close().catch(() => undefined))
  )

/** write `bytes` to a new temp file beside `file` (mode applied at creation and again with chmod, past the umask), fsynced */
const writeTemp = (file: string, bytes: Uint8Array, mode: number): Effect.Effect<string, AtomicWriteError> =>
  Effect.gen(function* () {
    const temp = tempPathFor(file)
    yield* Effect.acquireUseRelease(
      ioStep(temp, "create", () => fs.open(temp, "wx", mode)),
      (handle) =>
        Effect.gen(function* () {
          yield* ioStep(temp, "chmod", () => handle.chmod(mode))
          yield* ioStep(temp, "write", () => handle.writeFile(bytes))
          yield* ioStep(temp, "fsync", () => handle.sync())
        }),
      (handle) => Effect.promise(() => handle.close().catch(() => undefined))
    ).pipe(Effect.tapError(() => Effect.promise(() => fs.rm(temp, { force: true }).catch(() => undefined))))
    return temp
  })

/**
 * Removes a temporary file or directory (a failed step's, or one whose scope ends). It never
 * fails the step it cleans up after: a removal that fails is logged with its cause (`abox gc`
 * removes temp files left in a session directory), never a defect.
 */
export const removeTemp = (file: string): Effect.Effect<void> =>
  Effect.tryPromise({
    try: () => fs.rm(file, { recursive: true, force: true }),
    catch: (cause) =>
      new AtomicWriteError({ path: file, operation: "remove", reason: errorMessage(cause), cause })
  }).pipe(
    Effect.catchAll((error) => Effect.logWarning(`cannot remove ${file}: ${error.reason}`, error.cause))
  )

const removeQuietly = (file: string) =>
  Effect.promise(() => fs.rm(file, { force: true }).catch(() => undefined))

/** Atomically and durably replace (or create) `file` with `bytes`. */
export const writeFileAtomic = Effect.fn("atomicFile.writeFileAtomic")(function* (
  file: string,
  bytes: Uint8Array,
  mode: number = 0o600
) {
  const temp = yield* writeTemp(file, bytes, mode)
  yield* ioStep(file, "rename", () => fs.rename(temp, file)).pipe(Effect.tapError(() => removeQuietly(temp)))
  yield* fsyncDir(path.dirname(file))
})

/**
 * Atomically and durably create `file`, failing with `AlreadyExists` (and changing nothing)
 * if it exists: the content is complete before the name appears (link(2) never clobbers).
 */
export const writeFileExclusive = Effect.fn("atomicFile.writeFileExclusive")(function* (
  file: string,
  bytes: Uint8Array,
  mode: number = 0o600
) {
  const temp = yield* writeTemp(file, bytes, mode)
  yield* Effect.tryPromise({
    try: () => fs.link(temp, file),
    catch: (cause): AtomicWriteError | AlreadyExists =>
      errorCode(cause) === "EEXIST"
        ? new AlreadyExists({ path: file })
        : new AtomicWriteError({ path: file, operation: "link", reason: errorMessage(cause), cause })
  }).pipe(Effect.ensuring(removeQuietly(temp)))
  yield* fsyncDir(path.dirname(file))
})

/** JSON text as abox writes it: 2-space indent, trailing newline */
export const encodeJsonBytes = <A, I>(schema: Schema.Schema<A, I>, value: A) =>
  Schema.encode(schema)(value).pipe(
    Effect.mapError(
      (error) =>
        new AtomicWriteError({
          path: "",
          operation: "encode",
          reason: ParseResult.TreeFormatter.formatErrorSync(error),
          cause: error
        })
    ),
    Effect.map((encoded) => Buffer.from(JSON.stringify(encoded, null, 2) + "\n", "utf8"))
  )

/** Encode `value` with `schema` and write it atomically (mode 0600 unless told). */
export const writeJsonAtomic = Effect.fn("atomicFile.writeJsonAtomic")(function* <A, I>(
  file: string,
  schema: Schema.Schema<A, I>,
  value: A,
  mode: number = 0o600
) {
  const bytes = yield* encodeJsonBytes(schema, value).pipe(
    Effect.mapError(
      (e) => new AtomicWriteError({ path: file, operation: e.operation, reason: e.reason, cause: e.cause })
    )
  )
  yield* writeFileAtomic(file, bytes, mode)
})
