import * as FileSystem from "@effect/platform/FileSystem"
import type { PlatformError } from "@effect/platform/Error"
import * as Clock from "effect/Clock"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import type * as ParseResult from "effect/ParseResult"
import * as Schema from "effect/Schema"
import { createRequire } from "node:module"
// Raw node:fs for what FileSystem cannot express: an fd opened for an OFD/flock lock, a
// chmod that must not depend on the umask, and the synchronous stat of `dir`.
import * as nodeFsSync from "node:fs"
import * as nodeFs from "node:fs/promises"
import * as path from "node:path"
import { describeParseError } from "../lib/parseErrors.js"
import { type AtomicWriteError, fsyncDir, writeFileExclusive, writeJsonAtomic } from "../lib/atomicFile.js"
import { makeIdGenerator } from "../lib/ids.js"
import { describeNameProblem, nameProblem, sanitiseName } from "../lib/names.js"
import { GUEST_CONFIG_FORMAT, GuestConfig } from "../protocol/GuestConfig.js"
import { AboxPaths } from "../services/AboxPaths.js"
import {
  InvalidName,
  type NameBinding,
  NameTaken,
  type NewSession,
  type ReadError,
  SESSION_FORMAT,
  SessionCorrupt,
  SessionFormatTooNew,
  type SessionListing,
  SessionMeta,
  SessionNotFound,
  SessionStore,
  type SessionStoreShape,
  StoreIoError
} from "../services/SessionStore.js"
import {
  creatingDirName,
  nameFileName,
  nameLockPath,
  removingDirName,
  sessionFile,
  type SessionLocation
} from "../domain/sessionLayout.js"

export const NAME_FORMAT = 1

/** `names/<sanitised>.json`: the original name is kept so that colliding names are refused */
export const NameFile = Schema.Struct({
  format: Schema.Literal(NAME_FORMAT),
  name: Schema.String,
  sessionId: Schema.String,
  created: Schema.String
})
export type NameFile = typeof NameFile.Type

const DIR_MODE = 0o700
const FILE_MODE = 0o600
const LIST_CONCURRENCY = 32

const decodeJsonText = Schema.decodeUnknownEither(Schema.parseJson())
const FormatField = Schema.Struct({ format: Schema.Number })
const decodeFormatField = Schema.decodeUnknownOption(FormatField)
const decodeSessionMeta = Schema.decodeUnknownEither(SessionMeta)
/** as FileSystem.readFileString decodes (a BOM dropped, bad bytes replaced alike) */
const utf8 = new TextDecoder("utf-8")

/** a store file's text → its value, or why it is unusable (pure: `list` reads every session without a fiber each) */
const parseStoreFile = <A>(
  file: string,
  text: string,
  decode: (input: unknown) => Either.Either<A, ParseResult.ParseError>,
  supported: number
): Either.Either<A, SessionCorrupt | SessionFormatTooNew> => {
  const corrupt = (reason: string) =>
    Either.left(new SessionCorrupt({ path: file, reason, message: `${file} is corrupt: ${reason}` }))
  const json = decodeJsonText(text)
  if (Either.isLeft(json)) {
    return corrupt(
      text.trim().length === 0
        ? "the file is empty"
        : `not valid JSON (${(json.left.message.split("\n").at(-1) ?? "").replace(/^[\s└─]+/, "")})`
    )
  }
  const format = decodeFormatField(json.right)
  if (Option.isSome(format) && format.value.format > supported) {
    return Either.left(
      new SessionFormatTooNew({
        path: file,
        found: format.value.format,
        supported,
        message: `${file} has format ${format.value.format}; this abox reads format ${supported} (upgrade abox)`
      })
    )
  }
  const value = decode(json.right)
  return Either.isLeft(value) ? corrupt(describeParseError(value.left)) : Either.right(value.right)
}

/** session.json's text → the session it records, which must be the one in this directory */
const parseSessionMeta = (
  at: SessionLocation,
  text: string
): Either.Either<SessionMeta, SessionCorrupt | SessionFormatTooNew> => {
  const file = sessionFile(at.dir, "meta")
  return Either.flatMap(parseStoreFile(file, text, decodeSessionMeta, SESSION_FORMAT), (meta) => {
    if (meta.id === at.id) return Either.right(meta)
    const reason = `it records id "${meta.id}" but lives in directory "${at.id}"`
    return Either.left(new SessionCorrupt({ path: file, reason, message: `${file} is corrupt: ${reason}` }))
  })
}

interface FsLock {
  readonly waitForLock: (fd: number) => Promise<boolean>
  readonly unlock: (fd: number) => boolean
}
// Loaded on first use: a native addon the bundle keeps external, not needed by `list`/`show`.
let fsLock: FsLock | undefined
const loadFsLock = (): FsLock => (fsLock ??= createRequire(import.meta.url)("fs-native-extensions") as FsLock)

const reasonOf = (error: PlatformError): string => error.message

const isNotFound = (error: PlatformError): boolean =>
  error._tag === "SystemError" && error.reason === "NotFound"

/** a session id or name must be a single path segment */
const isSafeSegment = (s: string): boolean =>
  s.length > 0 && s.length <= 255 && !s.startsWith(".") && !/[/\\\0]/.test(s)

const ioError = (p: string, operation: string) => (error: PlatformError | AtomicWriteError) =>
  new StoreIoError({
    path: p,
    operation,
    message: `${operation} ${p}: ${error._tag === "AtomicWriteError" ? error.reason : reasonOf(error)}`
  })

export const makeSessionStore = Effect.gen(function* () {
  const fs = yield* FileSystem.FileSystem
  const paths = yield* AboxPaths
  const ids = makeIdGenerator()
  /** serialises name writers in this process; the flock serialises processes */
  const nameMutex = yield* Effect.makeSemaphore(1)

  const ensureDir = (dir: string) =>
    fs
      .makeDirectory(dir, { recursive: true, mode: DIR_MODE })
      .pipe(Effect.mapError(ioError(dir, "create directory")))

  const ensureHome = Effect.gen(function* () {
    yield* ensureDir(paths.home)
    yield* ensureDir(paths.sessions)
  })

  /**
   * Read and decode one JSON file of a session. Never writes: a bad file is reported with its
   * path and the reason and left as it is.
   */
  const readText = (file: string, ref: string) =>
    fs.readFileString(file).pipe(
      Effect.mapError((error) =>
        isNotFound(error)
          ? new SessionNotFound({ ref, message: `${file} does not exist` })
          : new StoreIoError({
              path: file,
              operation: "read",
              message: `cannot read ${file}: ${reasonOf(error)}`
            })
      )
    )

  const readJson = <A, I>(file: string, ref: string, schema: Schema.Schema<A, I>, supported: number) =>
    Effect.flatMap(readText(file, ref), (text) =>
      parseStoreFile(file, text, Schema.decodeUnknownEither(schema), supported)
    )

  /** the session directory of `id`: the current home first, then the legacy one */
  const locateId = (id: string): Effect.Effect<SessionLocation, SessionNotFound | StoreIoError> =>
    Effect.gen(function* () {
      if (!isSafeSegment(id)) return yield* new SessionNotFound({ ref: id, message: `no session "${id}"` })
      for (const [dir, legacy] of [
        [paths.sessionDir(id), false],
        [path.join(paths.legacySessions, id), true]
      ] as const) {
        const info = yield* fs.stat(dir).pipe(
          Effect.map(Option.some),
          Effect.catchIf(isNotFound, () => Effect.succeed(Option.none())),
          Effect.mapError(ioError(dir, "stat"))
        )
        if (Option.isSome(info) && info.value.type === "Directory") {
          return { id, dir, legacy }
        }
      }
      return yield* new SessionNotFound({ ref: id, message: `no session "${id}"` })
    })

  const readMeta = (at: SessionLocation): Effect.Effect<SessionMeta, ReadError> =>
    Effect.flatMap(readText(sessionFile(at.dir, "meta"), at.id), (text) => parseSessionMeta(at, text))

  const refuseLegacy = (at: SessionLocation, operation: string) =>
    at.legacy
      ? Effect.fail(
          new StoreIoError({
            path: at.dir,
            operation,
            message: `session ${at.id} is in the legacy home (${paths.legacySessions}), which abox never modifies`
          })
        )
      : Effect.void

  const get = Effect.fn("SessionStore.get")(function* (id: string) {
    return yield* readMeta(yield* locateId(id))
  })

  /**
   * session.json read synchronously (one readFileSync each: `abox list` reads every session,
   * docs/performance.md) and parsed as readMeta does; undefined when it cannot be read (readMeta
   * then says why)
   */
  const listedFromDisk = (at: SessionLocation): SessionListing | undefined => {
    let text: string
    try {
      text = utf8.decode(nodeFsSync.readFileSync(sessionFile(at.dir, "meta")))
    } catch {
      return undefined
    }
    const meta = parseSessionMeta(at, text)
    return Either.isRight(meta)
      ? { _tag: "Ok", ...at, meta: meta.right }
      : { _tag: "Corrupt", ...at, error: meta.left }
  }

  const listHome = (root: string, legacy: boolean) =>
    Effect.gen(function* () {
      const entries = yield* fs.readDirectory(root).pipe(
        Effect.catchIf(isNotFound, () => Effect.succeed([] as Array<string>)),
        Effect.mapError(ioError(root, "list"))
      )
      const candidates = entries.filter((e) => isSafeSegment(e)).sort()
      // The common case in one synchronous pass (one readFileSync and a compiled decoder per
      // session, no fiber or promise each: `abox list` reads every session, docs/performance.md);
      // a session that does not read back whole goes through readMeta, which reports it.
      const locations = candidates.map((id): SessionLocation => ({ id, dir: path.join(root, id), legacy }))
      const rows = yield* Effect.sync(() => locations.map(listedFromDisk))
      const reread = yield* Effect.forEach(
        rows.flatMap((row, i) => (row === undefined ? [locations[i]!] : [])),
        (at) =>
          readMeta(at).pipe(
            Effect.map((meta): Option.Option<SessionListing> => Option.some({ _tag: "Ok", ...at, meta })),
            Effect.catchAll((error) =>
              Effect.gen(function* () {
                if (error._tag !== "SessionNotFound") {
                  return Option.some<SessionListing>({ _tag: "Corrupt", ...at, error })
                }
                // no session.json: a stray file is not a session; a directory without one is broken
                const info = yield* fs.stat(at.dir).pipe(Effect.option)
                if (Option.isNone(info) || info.value.type !== "Directory")
                  return Option.none<SessionListing>()
                const file = sessionFile(at.dir, "meta")
                const reason = "session.json is missing"
                return Option.some<SessionListing>({
                  _tag: "Corrupt",
                  ...at,
                  error: new SessionCorrupt({
                    path: file,
                    reason,
                    message: `${at.dir} is not a usable session: ${reason}`
                  })
                })
              })
            )
          ),
        { concurrency: LIST_CONCURRENCY }
      )
      let next = 0
      return rows.flatMap((row): Array<SessionListing> => {
        const listed = row ?? reread[next++]!
        return Option.isOption(listed) ? (Option.isSome(listed) ? [listed.value] : []) : [listed]
      })
    })

  const list = Effect.fn("SessionStore.list")(function* () {
    const [current, legacy] = yield* Effect.all(
      [listHome(paths.sessions, false), listHome(paths.legacySessions, true)],
      {
        concurrency: 2
      }
    )
    return [...current, ...legacy] as ReadonlyArray<SessionListing>
  })

  // ---- names ----

  const nameFile = (stem: string) => path.join(paths.names, nameFileName(stem))

  /** hold the `<stem>.json.lock` flock (and the in-process mutex) while `use` runs */
  const withNameLock = <A, E>(stem: string, use: Effect.Effect<A, E>): Effect.Effect<A, E | StoreIoError> => {
    const lockPath = nameLockPath(nameFile(stem))
    return nameMutex.withPermits(1)(
      Effect.scoped(
        Effect.gen(function* () {
          yield* ensureDir(paths.names)
          yield* Effect.acquireRelease(
            Effect.tryPromise({
              try: async () => {
                const handle = await nodeFs.open(lockPath, "a", FILE_MODE)
                try {
                  await loadFsLock().waitForLock(handle.fd)
                } catch (cause) {
                  await handle.close()
                  throw cause
                }
                return handle
              },
              catch: (cause) =>
                new StoreIoError({
                  path: lockPath,
                  operation: "lock",
                  message: `cannot lock ${lockPath}: ${String(cause)}`
                })
            }),
            (handle) =>
              Effect.tryPromise({
                try: async () => {
                  try {
                    loadFsLock().unlock(handle.fd)
                  } finally {
                    await handle.close().catch(() => undefined)
                  }
                },
                catch: (cause) => cause
              }).pipe(
                // the lock goes with its descriptor, which is closed whatever the unlock did: a
                // failed unlock is logged with its cause, not a defect of the write it guarded
                Effect.catchAll((cause) => Effect.logWarning(`cannot unlock ${lockPath}`, cause))
              )
          )
          return yield* use
        })
      )
    )
  }

  const readNameFile = (stem: string, ref: string) => readJson(nameFile(stem), ref, NameFile, NAME_FORMAT)

  const toBinding = (file: NameFile): NameBinding => ({
    name: file.name,
    sessionId: file.sessionId,
    created: file.created
  })

  const checkName = (name: string) => {
    const problem = nameProblem(name)
    return problem === null
      ? Effect.succeed(sanitiseName(name))
      : Effect.fail(new InvalidName({ name, message: describeNameProblem(name, problem) }))
  }

  const exists = (id: string) =>
    locateId(id).pipe(
      Effect.as(true),
      Effect.catchTag("SessionNotFound", () => Effect.succeed(false))
    )

  const bindName = Effect.fn("SessionStore.bindName")(function* (name: string, id: string) {
    const stem = yield* checkName(name)
    // an existing session's id (a legacy one need not look like an id) is never a name
    if (yield* exists(name)) {
      return yield* new InvalidName({
        name,
        message: `"${name}" is the id of a session, which refs resolve first: choose another name`
      })
    }
    yield* locateId(id)
    return yield* withNameLock(
      stem,
      Effect.gen(function* () {
        const file = nameFile(stem)
        const existing = yield* readNameFile(stem, name).pipe(
          Effect.map(Option.some),
          Effect.catchTag("SessionNotFound", () => Effect.succeed(Option.none<NameFile>())),
          Effect.catchTags({
            SessionCorrupt: (e) =>
              new NameTaken({
                name,
                sessionId: "",
                message: `${file} exists but is unreadable (${e.reason}); it is left as it is`
              }),
            SessionFormatTooNew: (e) => new NameTaken({ name, sessionId: "", message: e.message })
          })
        )
        const created = new Date(yield* Clock.currentTimeMillis).toISOString()
        const binding: NameFile = { format: NAME_FORMAT, name, sessionId: id, created }
        if (Option.isSome(existing)) {
          const old = existing.value
          if (old.name !== name) {
            return yield* new NameTaken({
              name,
              sessionId: old.sessionId,
              message: `name "${name}" uses the same file as the existing name "${old.name}" (session ${old.sessionId}); choose another name`
            })
          }
          if (old.sessionId === id) return toBinding(old)
          if (yield* exists(old.sessionId)) {
            return yield* new NameTaken({
              name,
              sessionId: old.sessionId,
              message: `name "${name}" is already bound to session ${old.sessionId}`
            })
          }
          // a dangling binding of this very name: replace it (we hold its lock)
          yield* writeJsonAtomic(file, NameFile, binding, FILE_MODE).pipe(
            Effect.mapError(ioError(file, "write"))
          )
          return toBinding(binding)
        }
        const bytes = Buffer.from(JSON.stringify(binding, null, 2) + "\n", "utf8")
        yield* writeFileExclusive(file, bytes, FILE_MODE).pipe(
          Effect.catchTags({
            AlreadyExists: () =>
              new NameTaken({
                name,
                sessionId: "",
                message: `name "${name}" was bound concurrently by another process`
              }),
            AtomicWriteError: (e) => ioError(file, "create")(e)
          })
        )
        return toBinding(binding)
      })
    )
  })

  const lookupName = Effect.fn("SessionStore.lookupName")(function* (name: string) {
    // No lock for reads: every write of a binding is an atomic rename or link, so a reader
    // sees a whole binding or none; the lock only serialises check-then-write.
    if (nameProblem(name) !== null) {
      return yield* new SessionNotFound({ ref: name, message: `no session named "${name}"` })
    }
    const file = yield* readNameFile(sanitiseName(name), name).pipe(
      Effect.catchTag(
        "SessionNotFound",
        () => new SessionNotFound({ ref: name, message: `no session named "${name}"` })
      ),
      Effect.catchTag(
        "SessionFormatTooNew",
        (e) => new SessionCorrupt({ path: e.path, reason: e.message, message: e.message })
      )
    )
    if (file.name !== name) {
      return yield* new SessionNotFound({
        ref: name,
        message: `no session named "${name}" (its file belongs to "${file.name}")`
      })
    }
    return toBinding(file)
  })

  const unbindName = Effect.fn("SessionStore.unbindName")(function* (name: string) {
    if (nameProblem(name) !== null) {
      return yield* new SessionNotFound({ ref: name, message: `no session named "${name}"` })
    }
    const stem = sanitiseName(name)
    yield* withNameLock(
      stem,
      Effect.gen(function* () {
        const file = yield* readNameFile(stem, name).pipe(
          Effect.catchTags({
            SessionNotFound: () => new SessionNotFound({ ref: name, message: `no session named "${name}"` }),
            SessionCorrupt: (e) =>
              new StoreIoError({ path: e.path, operation: "unbind", message: e.message }),
            SessionFormatTooNew: (e) =>
              new StoreIoError({ path: e.path, operation: "unbind", message: e.message })
          })
        )
        if (file.name !== name) {
          return yield* new SessionNotFound({ ref: name, message: `no session named "${name}"` })
        }
        // the .lock file stays: unlinking a lock file others may be waiting on breaks the lock
        yield* fs.remove(nameFile(stem)).pipe(Effect.mapError(ioError(nameFile(stem), "remove")))
        yield* fsyncDir(paths.names).pipe(Effect.mapError(ioError(paths.names, "fsync")))
      })
    )
  })

  const listNames = Effect.fn("SessionStore.listNames")(function* () {
    const entries = yield* fs.readDirectory(paths.names).pipe(
      Effect.catchIf(isNotFound, () => Effect.succeed([] as Array<string>)),
      Effect.mapError(ioError(paths.names, "list"))
    )
    const stems = entries.filter((e) => !e.startsWith(".") && e.endsWith(".json")).map((e) => e.slice(0, -5))
    const files = yield* Effect.forEach(
      stems.sort(),
      (stem) =>
        readNameFile(stem, stem).pipe(
          Effect.map(Option.some),
          Effect.catchTag("StoreIoError", (e) => Effect.fail(e)),
          Effect.catchAll((e) =>
            Effect.logWarning(`skipping name file ${nameFile(stem)}: ${e.message}`).pipe(
              Effect.as(Option.none<NameFile>())
            )
          )
        ),
      { concurrency: LIST_CONCURRENCY }
    )
    return files.flatMap((f) => (Option.isSome(f) ? [toBinding(f.value)] : []))
  })

  const locate = Effect.fn("SessionStore.locate")(function* (ref: string) {
    const direct = yield* locateId(ref).pipe(Effect.option)
    if (Option.isSome(direct)) return direct.value
    const binding = yield* lookupName(ref).pipe(
      Effect.catchTag(
        "SessionNotFound",
        () => new SessionNotFound({ ref, message: `no session or session name "${ref}"` })
      )
    )
    const target = yield* locateId(binding.sessionId).pipe(
      Effect.catchTag(
        "SessionNotFound",
        () =>
          new SessionNotFound({
            ref,
            message: `name "${ref}" is dangling: its session ${binding.sessionId} no longer exists (abox rm ${ref} removes the name)`
          })
      )
    )
    return target
  })

  const resolve = Effect.fn("SessionStore.resolve")(function* (ref: string) {
    return (yield* locate(ref)).id
  })

  /** synchronous (SessionStoreShape.dir): one stat per home, nothing remembered between calls */
  const dir = (id: string): string => {
    const current = paths.sessionDir(id)
    if (!isSafeSegment(id)) return current
    const isDirectory = (p: string) =>
      nodeFsSync.statSync(p, { throwIfNoEntry: false })?.isDirectory() === true
    const legacy = path.join(paths.legacySessions, id)
    return !isDirectory(current) && isDirectory(legacy) ? legacy : current
  }

  // ---- writes ----

  const create = Effect.fn("SessionStore.create")(function* (input: NewSession) {
    if (input.name !== undefined) yield* checkName(input.name)
    yield* ensureHome
    const now = yield* Clock.currentTimeMillis
    const id = ids.next(now)
    const meta: SessionMeta = {
      format: SESSION_FORMAT,
      id,
      created: new Date(now).toISOString(),
      source: input.source,
      model: input.model,
      ...(input.name !== undefined ? { name: input.name } : {}),
      ...(input.image !== undefined ? { image: input.image } : {}),
      ...(input.guest !== undefined ? { guest: input.guest } : {}),
      ...(input.vmm !== undefined ? { vmm: input.vmm } : {}),
      ...(input.resources !== undefined ? { resources: input.resources } : {}),
      ...(input.policy !== undefined ? { policy: input.policy } : {})
    }
    // build the directory under a dot-name, then rename: a session appears whole or not at all
    const staging = path.join(paths.sessions, creatingDirName(id))
    const dir = paths.sessionDir(id)
    yield* Effect.gen(function* () {
      yield* fs
        .makeDirectory(staging, { mode: DIR_MODE })
        .pipe(Effect.mapError(ioError(staging, "create directory")))
      yield* Effect.tryPromise({
        try: () => nodeFs.chmod(staging, DIR_MODE),
        catch: () =>
          new StoreIoError({ path: staging, operation: "chmod", message: `cannot chmod ${staging}` })
      })
      yield* writeJsonAtomic(sessionFile(staging, "meta"), SessionMeta, meta, FILE_MODE).pipe(
        Effect.mapError(ioError(sessionFile(staging, "meta"), "write"))
      )
      yield* fs.rename(staging, dir).pipe(Effect.mapError(ioError(dir, "rename")))
      yield* fsyncDir(paths.sessions).pipe(Effect.mapError(ioError(paths.sessions, "fsync")))
    }).pipe(Effect.tapError(() => fs.remove(staging, { recursive: true }).pipe(Effect.ignore)))
    if (input.name !== undefined) {
      yield* bindName(input.name, id).pipe(
        Effect.catchTag(
          "SessionNotFound",
          (e) => new StoreIoError({ path: dir, operation: "bind name", message: e.message })
        ),
        Effect.tapError(() => fs.remove(dir, { recursive: true }).pipe(Effect.ignore))
      )
    }
    return meta
  })

  const update = Effect.fn("SessionStore.update")(function* (
    id: string,
    f: (meta: SessionMeta) => SessionMeta
  ) {
    const at = yield* locateId(id)
    yield* refuseLegacy(at, "update")
    const meta = yield* readMeta(at)
    const next: SessionMeta = { ...f(meta), format: SESSION_FORMAT, id: meta.id }
    const file = sessionFile(at.dir, "meta")
    yield* writeJsonAtomic(file, SessionMeta, next, FILE_MODE).pipe(Effect.mapError(ioError(file, "write")))
    return next
  })

  const remove = Effect.fn("SessionStore.remove")(function* (id: string) {
    const at = yield* locateId(id)
    yield* refuseLegacy(at, "remove")
    const names = yield* listNames()
    for (const binding of names.filter((b) => b.sessionId === id)) {
      yield* unbindName(binding.name).pipe(Effect.catchTag("SessionNotFound", () => Effect.void))
    }
    // rename first: the session disappears atomically even if the recursive delete is cut short
    const doomed = path.join(paths.sessions, removingDirName(id))
    yield* fs.rename(at.dir, doomed).pipe(Effect.mapError(ioError(at.dir, "rename")))
    yield* fsyncDir(paths.sessions).pipe(Effect.mapError(ioError(paths.sessions, "fsync")))
    yield* fs.remove(doomed, { recursive: true }).pipe(Effect.mapError(ioError(doomed, "remove")))
  })

  const readGuestConfig = Effect.fn("SessionStore.readGuestConfig")(function* (id: string) {
    const at = yield* locateId(id)
    return yield* readJson(sessionFile(at.dir, "guestConfig"), id, GuestConfig, GUEST_CONFIG_FORMAT)
  })

  const writeGuestConfig = Effect.fn("SessionStore.writeGuestConfig")(function* (
    id: string,
    config: GuestConfig
  ) {
    const at = yield* locateId(id).pipe(
      Effect.catchTag(
        "SessionNotFound",
        (e) => new StoreIoError({ path: paths.sessionDir(id), operation: "write", message: e.message })
      )
    )
    yield* refuseLegacy(at, "write guest-config.json")
    const file = sessionFile(at.dir, "guestConfig")
    yield* writeJsonAtomic(file, GuestConfig, config, FILE_MODE).pipe(Effect.mapError(ioError(file, "write")))
  })

  return SessionStore.of({
    create,
    get,
    list,
    update,
    remove,
    dir,
    readGuestConfig,
    writeGuestConfig,
    locate,
    resolve,
    bindName,
    lookupName,
    unbindName,
    listNames
  } satisfies SessionStoreShape)
})

export const SessionStoreLive = Layer.effect(SessionStore, makeSessionStore)
