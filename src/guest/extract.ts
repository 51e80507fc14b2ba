/**
 * Safe, streaming tar extraction into the repository directory (the host's snapshot transfer).
 *
 * The tar stream is parsed by `tar`'s Parser (nothing is buffered whole: the Parser's back
 * pressure reaches the mux channel, whose credit reaches the host). Every entry is then written
 * here, one at a time and in order, with these rules:
 * - a path that is absolute, contains `..`, or is empty is refused (the transfer fails);
 * - every parent component is checked with lstat and must be a real directory: a symlink entry
 *   followed by an entry through that link (`link -> /etc`, then `link/passwd`) is refused;
 * - a file replaces whatever non-directory was at its path (unlink, then O_EXCL|O_NOFOLLOW
 *   create): a symlink at the final component is replaced, never followed;
 * - symlinks are recreated as links with their target as-is (never followed by this code);
 * - hard links must name a regular file already extracted inside the repo (checked the same way);
 * - devices, FIFOs and other special entries are skipped;
 * - modes keep the permission bits only (no setuid/setgid/sticky); everything is owned by the
 *   unprivileged user when running as root.
 * Known limit: the checks are lstat-then-act, so a process writing into the repo *during* a
 * transfer could race them; transfers run before any turn, when nothing else writes there.
 *
 * Speed without giving up any rule: a directory checked (or created) once stays a directory
 * (no entry may replace one), so it is not lstat'ed again; a file is created with O_EXCL first
 * and the existing path is only examined when that fails; file content goes out in batched
 * writev calls with a bounded amount in flight (WRITE_AHEAD), so receiving, parsing and writing
 * overlap; a file whose bytes are all queued is finished (writes, metadata, close) while the next
 * entries go on (at most MAX_FINISHING such files); the Parser gets 512-byte aligned chunks so
 * that it never concatenates buffers.
 */
import { constants as fsConstants } from "node:fs"
import * as fs from "node:fs/promises"
import type { FileHandle } from "node:fs/promises"
import * as path from "node:path"
import { Parser } from "tar/parse"
import type { ReadEntry } from "tar/read-entry"
import { errorMessage } from "../domain/errorMessage.js"

export class ExtractError extends Error {
  readonly reason: string
  /** `cause`: the error of the operation that failed (a write, a parse), kept as it came */
  constructor(reason: string, cause?: unknown) {
    super(`tar extraction failed: ${reason}`, cause === undefined ? undefined : { cause })
    this.name = "ExtractError"
    this.reason = reason
  }
}

export interface ExtractOptions {
  /** chown every created entry (root only) */
  readonly owner?: { readonly uid: number; readonly gid: number }
  /**
   * The host reading an archive the guest made (src/lib/hostExtract.ts): devices, FIFOs and
   * other special entries are refused (not skipped), sizes and entry counts are bounded (checked
   * on each header, before any byte is written), and with `linksInside` a symlink must point
   * inside the tree (relative, never above it).
   */
  readonly untrusted?: UntrustedRules
  /** stop: the source is no longer read (its iterator is returned) and the extraction fails */
  readonly signal?: AbortSignal
  /** the tar is one layer of an OCI image applied over the tree (src/lib/oci): see `LayerRules` */
  readonly layer?: LayerRules
}

/** what a layer's entry carries that the host copy does not keep: set later in the image's file system */
export interface LayerEntry {
  readonly type: "Directory" | "File" | "SymbolicLink" | "FIFO"
  /** permission bits with setuid, setgid and sticky (0o7777) */
  readonly mode: number
  readonly uid: number
  readonly gid: number
}

/**
 * An OCI image layer (image-spec layer.md) applied over what the lower layers extracted:
 * - `.wh.<name>` removes the lower layers' `<name>` (a directory with all below it) and is not
 *   written; `.wh..wh..opq` removes what lower layers put in its directory (what this layer
 *   writes there stays, in whichever order the tar lists them);
 * - an entry may replace a lower layer's directory by a file (or a file by a directory);
 * - a FIFO is kept as an empty placeholder file, told to `record` as a FIFO (the image's file
 *   system makes the real one); devices stay refused (`untrusted` should be set too);
 * - every file, directory, symlink and FIFO written is told to `record` with its owner and full
 *   mode; the host copy keeps owner read/write (and search) access so that it can be read back.
 */
export interface LayerRules {
  readonly record: (parts: ReadonlyArray<string>, entry: LayerEntry) => void
  /** a whiteout removed this path (and everything below it) */
  readonly removed: (parts: ReadonlyArray<string>) => void
}

const WHITEOUT = ".wh."
const OPAQUE = ".wh..wh..opq"

export interface UntrustedRules {
  /** file bytes in all, as the headers declare them (skipped entries count too) */
  readonly maxBytes: number
  /** bytes of one file, as its header declares them */
  readonly maxFileBytes?: number | undefined
  readonly maxEntries: number
  /**
   * symlinks must stay inside this subtree of the archive (its components; [] = the whole
   * tree): what was copied, so that no link of it points at what is beside it on the host
   */
  readonly linksWithin?: ReadonlyArray<string> | undefined
  /** entries with a `.git` component (a repository's metadata, its config and hooks): skipped */
  readonly skipGit?: boolean | undefined
}

/**
 * A name that git (and a case-insensitive file system, as macOS's) takes for `.git`: any case,
 * and the code points HFS+ ignores in a name (git's is_hfs_dotgit).
 */
export const isGitName = (name: string): boolean =>
  name.replace(/[\u200c-\u200f\u202a-\u202e\u206a-\u206f\ufeff]/g, "").toLowerCase() === ".git"

/**
 * A link target that stays inside the subtree `within` from the link's own directory (parts of
 * the entry path, `within` a prefix of them): relative, its `..` only leading (a `..` after a
 * name could climb out of a directory a link named), never above `within`.
 */
export const linkStaysInside = (
  entryParts: ReadonlyArray<string>,
  linkpath: string,
  within: ReadonlyArray<string> = []
): boolean => {
  if (linkpath.startsWith("/")) return false
  if (entryParts.length <= within.length || within.some((part, i) => entryParts[i] !== part)) return false
  let depth = entryParts.length - 1 - within.length
  let named = false
  for (const part of linkpath.split("/")) {
    if (part === "" || part === ".") continue
    if (part === "..") {
      if (named || depth === 0) return false
      depth--
    } else named = true
  }
  return true
}

export interface ExtractResult {
  /** regular files, symlinks and hard links created */
  readonly files: number
  /** bytes of regular file content written */
  readonly bytes: number
  /** special entries that were skipped (devices, FIFOs, ...) */
  readonly skipped: number
}

const isErrno = (error: unknown, code: string): boolean =>
  typeof error === "object" && error !== null && (error as { code?: unknown }).code === code

/** The relative components of an entry path, or a reason it is refused. */
export const safeComponents = (entryPath: string): ReadonlyArray<string> | string => {
  if (entryPath.includes("\0")) return "path contains a NUL byte"
  // POSIX names: `/` is the only separator; `\` and `:` are ordinary characters of a name
  if (entryPath.startsWith("/")) return "absolute path"
  const parts = entryPath.split("/").filter((part) => part !== "" && part !== ".")
  if (parts.includes("..")) return "path contains '..'"
  return parts
}

const describe = (entry: ReadEntry): string => JSON.stringify(entry.path)

/** permission bits only: no setuid, setgid or sticky bit in a user's repository */
const permissions = (mode: number | undefined, fallback: number): number =>
  mode === undefined ? fallback : mode & 0o777

/** file bytes queued or being written per file before the parser (and so the channel) waits */
export const WRITE_AHEAD = 1024 * 1024
/** files being finished (last writes, metadata, close) while the next entries go on */
const MAX_FINISHING = 4
const BLOCK = 512
/**
 * what may follow an archive's end (its two zero blocks): tar writers pad to their record size
 * (GNU tar 10 KiB); more is a sender that never finishes, refused instead of read forever
 */
const MAX_PAST_END = 1024 * 1024

/**
 * A file's content on its way to disk: chunks are queued and written in one writev per batch,
 * one batch at a time (in order), while more arrive. `push` reports whether the caller may go on
 * (less than WRITE_AHEAD queued); `drained` waits for everything queued so far.
 */
class FileSink {
  private queue: Array<Buffer> = []
  private queuedBytes = 0
  private writing: Promise<void> | undefined = undefined
  private failure: unknown = undefined

  constructor(private readonly handle: FileHandle) {}

  push(chunk: Buffer): boolean {
    if (this.failure !== undefined) throw this.failure
    this.queue.push(chunk)
    this.queuedBytes += chunk.length
    this.writing ??= this.flush()
    return this.queuedBytes < WRITE_AHEAD
  }

  /** resolves when at most WRITE_AHEAD / 2 bytes are left queued (or throws a write's error) */
  async belowHalf(): Promise<void> {
    while (this.writing !== undefined && this.queuedBytes > WRITE_AHEAD / 2) await this.writing
    if (this.failure !== undefined) throw this.failure
  }

  async drained(): Promise<void> {
    while (this.writing !== undefined) await this.writing
    if (this.failure !== undefined) throw this.failure
  }

  /** one batch; the next batch starts when it is done */
  private flush(): Promise<void> {
    const batch = this.queue
    const total = this.queuedBytes
    this.queue = []
    return this.handle.writev(batch).then(
      ({ bytesWritten }) => {
        this.queuedBytes -= total
        if (bytesWritten !== total) {
          this.failure = new ExtractError(`short write: ${bytesWritten} of ${total} bytes`)
        }
        this.writing = this.failure === undefined && this.queue.length > 0 ? this.flush() : undefined
      },
      (error: unknown) => {
        this.failure = error
        this.writing = undefined
      }
    )
  }
}

export const extractTar = async (
  source: AsyncIterable<Uint8Array>,
  repoDir: string,
  options: ExtractOptions = {}
): Promise<ExtractResult> => {
  const root = path.resolve(repoDir)
  await fs.mkdir(root, { recursive: true, mode: 0o755 })
  if (options.owner !== undefined) await fs.chown(root, options.owner.uid, options.owner.gid)

  let files = 0
  let bytes = 0
  let skipped = 0
  let failure: unknown = undefined
  let chain: Promise<void> = Promise.resolve()

  const layer = options.layer
  /** the host copy's mode: permission bits, and for a layer the owner's access besides */
  const hostMode = (mode: number | undefined, fallback: number, dir: boolean): number =>
    layer === undefined ? permissions(mode, fallback) : permissions(mode, fallback) | (dir ? 0o700 : 0o600)
  /** paths this layer wrote: a whiteout (and an opaque directory) leaves them */
  const written = new Set<string>()
  const tell = (entry: ReadEntry, parts: ReadonlyArray<string>, type: LayerEntry["type"]) =>
    layer?.record(parts, {
      type,
      mode: (entry.mode ?? (type === "Directory" ? 0o755 : 0o644)) & 0o7777,
      uid: entry.uid ?? 0,
      gid: entry.gid ?? 0
    })

  const own = async (target: string, link: boolean) => {
    if (options.owner === undefined) return
    if (link) await fs.lchown(target, options.owner.uid, options.owner.gid)
    else await fs.chown(target, options.owner.uid, options.owner.gid)
  }

  /**
   * Directories already checked (or created) by this extraction. Nothing here removes or
   * replaces a directory (`clear` refuses to), so one that was a real directory stays one.
   */
  const knownDirs = new Set<string>([root])

  /** walk the parent components from the root, creating missing dirs; refuse anything but dirs */
  const parentDir = async (parts: ReadonlyArray<string>, entry: ReadEntry): Promise<string> => {
    let current = root
    for (const part of parts) {
      current = path.join(current, part)
      if (knownDirs.has(current)) continue
      let stat
      try {
        stat = await fs.lstat(current)
      } catch (error) {
        if (!isErrno(error, "ENOENT")) throw error
        await fs.mkdir(current, { mode: 0o755 })
        await own(current, false)
        knownDirs.add(current)
        continue
      }
      if (stat.isSymbolicLink()) {
        throw new ExtractError(`${describe(entry)} goes through the symbolic link ${JSON.stringify(part)}`)
      }
      if (!stat.isDirectory()) {
        throw new ExtractError(
          `${describe(entry)} goes through ${JSON.stringify(part)}, which is not a directory`
        )
      }
      knownDirs.add(current)
    }
    return current
  }

  /** remove a non-directory at `target` so that a fresh entry can take its place */
  const clear = async (target: string, entry: ReadEntry) => {
    let stat
    try {
      stat = await fs.lstat(target)
    } catch (error) {
      if (isErrno(error, "ENOENT")) return
      throw error
    }
    if (stat.isDirectory()) {
      // a layer replaces a lower layer's directory (never one it wrote itself)
      if (layer === undefined || written.has(target))
        throw new ExtractError(`${describe(entry)} would replace a directory`)
      await removeLower(target)
      return
    }
    await fs.unlink(target)
  }

  /** remove a lower layer's entry (a directory with all below it; links are removed, never followed) */
  const removeLower = async (target: string) => {
    await fs.rm(target, { recursive: true, force: true })
    for (const dir of knownDirs)
      if (dir === target || dir.startsWith(target + path.sep)) knownDirs.delete(dir)
    layer?.removed(path.relative(root, target).split(path.sep))
  }

  /** `.wh..wh..opq` in `dir`: what lower layers put below it goes, what this layer wrote stays */
  const opaque = async (dir: string): Promise<void> => {
    for (const name of await fs.readdir(dir)) {
      const child = path.join(dir, name)
      if (!written.has(child)) await removeLower(child)
      else if ((await fs.lstat(child)).isDirectory()) await opaque(child)
    }
  }

  /** a fresh file at `target` (never through a link): O_EXCL first, else clear the path and retry */
  const create = async (target: string, entry: ReadEntry): Promise<FileHandle> => {
    const flags = fsConstants.O_WRONLY | fsConstants.O_CREAT | fsConstants.O_EXCL | fsConstants.O_NOFOLLOW
    try {
      return await fs.open(target, flags, 0o600)
    } catch (error) {
      if (!isErrno(error, "EEXIST")) throw error
    }
    await clear(target, entry)
    return fs.open(target, flags, 0o600)
  }

  /**
   * Files whose bytes have all been received and that are still being written, set to their
   * metadata and closed: the next entries go on meanwhile (their checks do not depend on it;
   * a hard link to such a file links its inode, which exists from its creation).
   */
  const finishing = new Set<Promise<void>>()
  /** the files whose bytes are being received: failed when the extraction stops under them */
  const receiving = new Set<(error: unknown) => void>()

  const writeFile = async (target: string, entry: ReadEntry) => {
    const handle = await create(target, entry)
    let closeHere = true
    try {
      const sink = new FileSink(handle)
      // the entry flows into the sink as the Parser writes it (no promise per chunk); while
      // WRITE_AHEAD bytes are queued it is paused, which holds the Parser and so the channel
      await new Promise<void>((resolve, reject) => {
        let failed = false
        const fail = (error: unknown) => {
          failed = true
          receiving.delete(fail)
          reject(error)
        }
        // stopped with the entry's bytes still to come: they never will
        receiving.add(fail)
        entry.once("end", () => {
          receiving.delete(fail)
          resolve()
        })
        entry.once("error", fail)
        entry.on("data", (chunk: Buffer) => {
          // after a failure the caller resumes the entry to skip its bytes: they are dropped
          if (failed) return
          bytes += chunk.length
          let more: boolean
          try {
            more = sink.push(chunk)
          } catch (error) {
            fail(error)
            return
          }
          if (!more) {
            entry.pause()
            sink.belowHalf().then(() => {
              if (!failed) entry.resume()
            }, fail)
          }
        })
      })
      const { uid, gid } = options.owner ?? {}
      const mode = hostMode(entry.mode, 0o644, false)
      const mtime = entry.mtime
      closeHere = false
      const done: Promise<void> = (async () => {
        try {
          await sink.drained()
          await Promise.all([
            handle.chmod(mode),
            uid === undefined || gid === undefined ? undefined : handle.chown(uid, gid),
            mtime === undefined ? undefined : handle.utimes(mtime, mtime)
          ])
        } finally {
          await handle.close()
        }
      })()
        .catch((error: unknown) => {
          failure ??= error
        })
        .finally(() => finishing.delete(done))
      finishing.add(done)
      // bounded: at most MAX_FINISHING files (and their queued bytes) in the background
      while (finishing.size >= MAX_FINISHING) await Promise.race(finishing)
    } finally {
      if (closeHere) await handle.close()
    }
  }

  let entries = 0
  /** file bytes the headers declared so far (untrusted): checked before any of them is read */
  let declared = 0
  const untrusted = options.untrusted
  const handle = async (entry: ReadEntry): Promise<void> => {
    if (failure !== undefined) return
    const parts = safeComponents(entry.path)
    if (typeof parts === "string") throw new ExtractError(`${describe(entry)}: ${parts}`)
    if (untrusted !== undefined) {
      if (++entries > untrusted.maxEntries) {
        throw new ExtractError(`more than ${untrusted.maxEntries} entries`)
      }
      if (entry.type === "File" || entry.type === "OldFile" || entry.type === "ContiguousFile") {
        const size = entry.size ?? 0
        if (untrusted.maxFileBytes !== undefined && size > untrusted.maxFileBytes) {
          throw new ExtractError(
            `${describe(entry)} is too big: ${size} bytes, more than the limit of ${untrusted.maxFileBytes} for one file`
          )
        }
        declared += size
        if (declared > untrusted.maxBytes) {
          throw new ExtractError(
            `${describe(entry)} (${size} bytes) is too big: it takes the archive over the limit of ${untrusted.maxBytes} bytes in all`
          )
        }
      }
      const kept = ["Directory", "File", "OldFile", "ContiguousFile", "SymbolicLink", "Link"]
      if (!kept.includes(entry.type) && !(layer !== undefined && entry.type === "FIFO")) {
        throw new ExtractError(`${describe(entry)}: ${entry.type} entries are refused`)
      }
      if (untrusted.skipGit === true && parts.some((part) => isGitName(part))) {
        skipped++
        return
      }
      if (
        entry.type === "SymbolicLink" &&
        untrusted.linksWithin !== undefined &&
        !linkStaysInside(parts, entry.linkpath ?? "", untrusted.linksWithin)
      ) {
        throw new ExtractError(
          `${describe(entry)}: the link points outside what was copied (${JSON.stringify(entry.linkpath)})`
        )
      }
    }
    if (parts.length === 0) {
      // the archive's root ("./"): the repo dir itself
      if (entry.type === "Directory") return
      throw new ExtractError(`${describe(entry)}: empty path`)
    }
    const dir = await parentDir(parts.slice(0, -1), entry)
    const last = parts[parts.length - 1]!
    const target = path.join(dir, last)
    if (layer !== undefined && last.startsWith(WHITEOUT)) {
      if (last === OPAQUE) await opaque(dir)
      else {
        const hidden = last.slice(WHITEOUT.length)
        const lower = path.join(dir, hidden)
        if (hidden === "" || hidden === "." || hidden === "..")
          throw new ExtractError(`${describe(entry)}: a whiteout of no name`)
        if (!written.has(lower) && (await fs.lstat(lower).catch(() => undefined)) !== undefined)
          await removeLower(lower)
      }
      return
    }
    written.add(target)
    switch (entry.type) {
      case "Directory": {
        let stat
        try {
          stat = await fs.lstat(target)
        } catch (error) {
          if (!isErrno(error, "ENOENT")) throw error
        }
        if (stat !== undefined && !stat.isDirectory() && layer !== undefined) {
          // a layer's directory where a lower layer had a file
          await fs.unlink(target)
          stat = undefined
        }
        if (stat === undefined) {
          await fs.mkdir(target, { mode: 0o700 })
        } else if (!stat.isDirectory()) {
          throw new ExtractError(`${describe(entry)}: a non-directory is already there`)
        }
        await Promise.all([fs.chmod(target, hostMode(entry.mode, 0o755, true)), own(target, false)])
        knownDirs.add(target)
        tell(entry, parts, "Directory")
        return
      }
      case "File":
      case "OldFile":
      case "ContiguousFile": {
        await writeFile(target, entry)
        tell(entry, parts, "File")
        files++
        return
      }
      case "FIFO": {
        // skipped as any special entry, except in a layer (`untrusted` refuses them otherwise)
        if (layer === undefined) {
          skipped++
          return
        }
        // a placeholder on the host: the image's file system gets the FIFO
        await clear(target, entry)
        await (
          await fs.open(
            target,
            fsConstants.O_WRONLY | fsConstants.O_CREAT | fsConstants.O_EXCL | fsConstants.O_NOFOLLOW,
            0o600
          )
        ).close()
        tell(entry, parts, "FIFO")
        files++
        return
      }
      case "SymbolicLink": {
        const linkpath = entry.linkpath ?? ""
        if (linkpath === "" || linkpath.includes("\0"))
          throw new ExtractError(`${describe(entry)}: bad link target`)
        await clear(target, entry)
        await fs.symlink(linkpath, target)
        await own(target, true)
        tell(entry, parts, "SymbolicLink")
        files++
        return
      }
      case "Link": {
        const linkParts = safeComponents(entry.linkpath ?? "")
        if (typeof linkParts === "string" || linkParts.length === 0) {
          throw new ExtractError(
            `${describe(entry)}: hard link target ${JSON.stringify(entry.linkpath)} is not inside the repository`
          )
        }
        const linkDir = await parentDir(linkParts.slice(0, -1), entry)
        const existing = path.join(linkDir, linkParts[linkParts.length - 1]!)
        const stat = await fs.lstat(existing).catch(() => undefined)
        if (stat === undefined || !stat.isFile()) {
          throw new ExtractError(
            `${describe(entry)}: hard link target ${JSON.stringify(entry.linkpath)} is not a file extracted here`
          )
        }
        await clear(target, entry)
        await fs.link(existing, target)
        files++
        return
      }
      default:
        // devices, FIFOs, and anything tar does not map onto a plain file: skipped
        skipped++
        return
    }
  }

  /** the archive's end (two zero blocks) was read, and whether any entry came before it */
  let sawEnd = false
  let pastEnd = 0
  let sawEntry = false
  const parser = new Parser({
    strict: true,
    // entries are consumed by `handle`, in order; the parser waits for each one (back pressure)
    noResume: true,
    onReadEntry: (entry) => {
      sawEntry = true
      chain = chain
        .then(() => handle(entry))
        .catch((error: unknown) => {
          failure ??= error
        })
        // whatever happened, the entry's remaining bytes are consumed so the parser moves on
        .finally(() => entry.resume())
    }
  })
  // strict: tar's warnings (bad checksums, truncated input, not a tar) are 'error' events
  const eof = new Promise<void>((resolve) =>
    parser.on("eof", () => {
      sawEnd = true
      resolve()
    })
  )
  const parserDone = new Promise<void>((resolve, reject) => {
    parser.on("end", () => resolve())
    parser.on("error", (error: unknown) =>
      // the archive of nothing (its end and no entry: what `tar -c` of no file writes) is valid;
      // the Parser calls it unrecognized, as it does input that is no archive at all
      isErrno(error, "TAR_BAD_ARCHIVE") && sawEnd && !sawEntry ? resolve() : reject(error)
    )
  })
  parserDone.catch((error: unknown) => {
    failure ??= error
  })

  const feed = async (chunk: Buffer) => {
    if (parser.write(chunk)) return
    // a parser that failed emits no drain: its error ends the wait (and is the failure)
    // nor does one past the archive's end (its two zero blocks): what follows is not read
    await Promise.race([
      new Promise<void>((resolve) => parser.once("drain", () => resolve())),
      parserDone.catch(() => undefined),
      eof
    ])
  }
  /** bytes of an incomplete 512-byte block, held until the next chunk completes it */
  let tail: Buffer | undefined = undefined
  // a refusal or the signal stops the reading: the source is returned (the sender stopped),
  // never drained to its end
  const iterator = source[Symbol.asyncIterator]()
  const signal = options.signal
  const ABORTED = Symbol("aborted")
  const aborted = new Promise<typeof ABORTED>((resolve) => {
    if (signal?.aborted === true) resolve(ABORTED)
    signal?.addEventListener("abort", () => resolve(ABORTED), { once: true })
  })
  let returned = false
  const stopSource = () => {
    if (returned) return
    returned = true
    // a pending next() is left behind: return() ends the source under it
    void Promise.resolve(iterator.return?.()).catch(() => undefined)
  }
  while (true) {
    if (failure !== undefined) break
    const next = await Promise.race([iterator.next(), aborted])
    if (next === ABORTED) {
      failure ??= new ExtractError("stopped")
      break
    }
    if (next.done === true) {
      returned = true
      break
    }
    // past the archive's end: the rest of the source is read (its sender finishes as before)
    // but not parsed (the Parser takes no more, and would hold the reading forever), up to a bound
    if (sawEnd) {
      pastEnd += next.value.length
      if (pastEnd > MAX_PAST_END) {
        failure ??= new ExtractError(`more than ${MAX_PAST_END} bytes after the archive's end`)
        break
      }
      continue
    }
    const bytes = next.value
    // the Parser works in 512-byte blocks and concatenates (copies) whatever is left over with
    // the next chunk: hand it whole blocks only, so that file data is passed on as views
    let chunk = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength)
    if (tail !== undefined) {
      const need = BLOCK - tail.length
      if (chunk.length < need) {
        tail = Buffer.concat([tail, chunk])
        continue
      }
      const block = Buffer.concat([tail, chunk.subarray(0, need)])
      tail = undefined
      chunk = chunk.subarray(need)
      await feed(block)
    }
    const whole = chunk.length - (chunk.length % BLOCK)
    if (whole < chunk.length) tail = Buffer.from(chunk.subarray(whole))
    if (whole > 0) await feed(chunk.subarray(0, whole))
  }
  if (failure !== undefined) stopSource()
  if (failure === undefined) {
    // a truncated archive leaves a partial block: the Parser reports it
    if (tail !== undefined) parser.write(tail)
    parser.end()
    await parserDone.catch(() => undefined)
  } else {
    parser.abort(new Error("extraction stopped"))
    for (const fail of [...receiving]) fail(failure)
  }
  await chain
  while (finishing.size > 0) await Promise.all(finishing)
  if (failure !== undefined) {
    throw failure instanceof ExtractError ? failure : new ExtractError(errorMessage(failure), failure)
  }
  return { files, bytes, skipped }
}
