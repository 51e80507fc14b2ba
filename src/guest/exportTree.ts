/**
 * The guest → host direction of a transfer (`export_begin`, docs/protocol.md): a tar of part of
 * the repository (or of the baseline recorded at Open) written on a host-chosen channel. The
 * archive is made by the system's `tar` (busybox in the image, GNU tar under FakeVmm): native,
 * symlinks stored as links, never followed. The repository is read as the turn user (what a
 * turn could read anyway: a link planted in a path the host names leads nowhere a turn could
 * not go); the baseline, root's own read-only copy, as root. The host checks every entry as
 * an attacker's (src/lib/hostExtract.ts).
 */
import { spawn } from "node:child_process"
import { constants as fsConstants } from "node:fs"
import * as fs from "node:fs/promises"
import type { FileHandle } from "node:fs/promises"
import { safeComponents } from "./extract.js"

export interface ExportSink {
  write(chunk: Uint8Array): Promise<void>
  end(): Promise<void>
}

export interface ExportOptions {
  /** run tar as this user (root only) */
  readonly user?: { readonly uid: number; readonly gid: number } | undefined
}

interface EntryStat {
  readonly kind: "file" | "link" | "other"
  readonly mode: bigint
  readonly size: bigint
  readonly mtimeNs: bigint
  readonly ctimeNs: bigint
  readonly target?: string
}

const PROC_FD = "/proc/self/fd"
const DIRECTORY_FLAGS = fsConstants.O_RDONLY | fsConstants.O_DIRECTORY | fsConstants.O_NOFOLLOW

/**
 * Every non-directory entry under `dir` (less top-level `exclude`), by relative path. The agent
 * walks as root a tree the turn user writes, so no directory is read by its path: each is
 * opened here (O_DIRECTORY|O_NOFOLLOW), checked to be the inode its parent listed, and read
 * and stat'ed through its descriptor (/proc/self/fd/N), so that a directory swapped for a
 * link during the walk leads nowhere. Without /proc (FakeVmm on macOS) the paths are used.
 */
const walkEntries = async (dir: string, exclude: ReadonlyArray<string>): Promise<Map<string, EntryStat>> => {
  const out = new Map<string, EntryStat>()
  const byDescriptor = await fs.access(PROC_FD).then(
    () => true,
    () => false
  )
  const root = await fs.lstat(dir, { bigint: true }).catch(() => undefined)
  if (root === undefined || !root.isDirectory()) return out
  const pending: Array<{
    readonly rel: string
    readonly path: string
    readonly dev: bigint
    readonly ino: bigint
  }> = [{ rel: "", path: dir, dev: root.dev, ino: root.ino }]
  while (pending.length > 0) {
    const { rel, path, dev, ino } = pending.pop()!
    let handle: FileHandle | undefined
    let at = path
    if (byDescriptor) {
      try {
        handle = await fs.open(path, DIRECTORY_FLAGS)
        const opened = await handle.stat({ bigint: true })
        // not the directory its parent listed: it was replaced meanwhile
        if (opened.dev !== dev || opened.ino !== ino) {
          await handle.close()
          continue
        }
      } catch {
        await handle?.close()
        continue
      }
      at = `${PROC_FD}/${handle.fd}`
    }
    try {
      let names: Array<string>
      try {
        names = await fs.readdir(at)
      } catch {
        continue
      }
      for (const name of names) {
        if (rel === "" && exclude.includes(name)) continue
        const relPath = rel === "" ? name : `${rel}/${name}`
        const full = `${at}/${name}`
        const stat = await fs.lstat(full, { bigint: true }).catch(() => undefined)
        if (stat === undefined) continue
        if (stat.isDirectory()) {
          pending.push({ rel: relPath, path: `${path}/${name}`, dev: stat.dev, ino: stat.ino })
          continue
        }
        const kind = stat.isFile() ? "file" : stat.isSymbolicLink() ? "link" : "other"
        const target = kind === "link" ? await fs.readlink(full).catch(() => "") : undefined
        out.set(relPath, {
          kind,
          mode: stat.mode,
          size: stat.size,
          mtimeNs: stat.mtimeNs,
          ctimeNs: stat.ctimeNs,
          ...(target === undefined ? {} : { target })
        })
      }
    } finally {
      await handle?.close()
    }
  }
  return out
}

const same = (a: EntryStat, b: EntryStat): boolean =>
  a.kind === b.kind &&
  a.mode === b.mode &&
  a.size === b.size &&
  a.mtimeNs === b.mtimeNs &&
  a.ctimeNs === b.ctimeNs &&
  a.target === b.target

/**
 * The entries that differ between the repository and the baseline, per tree: a file or link
 * whose type, mode, size, mtime, ctime or target differs, or that is on one side only. The
 * repository disk is a block-level overlay of the baseline, so an untouched file keeps even its
 * ctime (which no user can set back); after a tar transfer the baseline is a copy and every
 * file counts as changed (the whole tree goes, as before). Directories are not listed: their
 * files are, and the extractor makes their parents.
 */
export const changedEntries = async (
  repoDir: string,
  baseDir: string,
  exclude: ReadonlyArray<string>
): Promise<{ readonly repo: ReadonlyArray<string>; readonly baseline: ReadonlyArray<string> }> => {
  const [repo, base] = await Promise.all([walkEntries(repoDir, exclude), walkEntries(baseDir, exclude)])
  const inRepo: Array<string> = []
  const inBase: Array<string> = []
  for (const [rel, entry] of repo) {
    const old = base.get(rel)
    if (old === undefined || !same(entry, old)) {
      inRepo.push(`./${rel}`)
      if (old !== undefined) inBase.push(`./${rel}`)
    }
  }
  for (const rel of base.keys()) if (!repo.has(rel)) inBase.push(`./${rel}`)
  return { repo: inRepo.sort(), baseline: inBase.sort() }
}

/** two zero blocks: the end of an archive, and all of the archive of nothing */
const END_OF_ARCHIVE = new Uint8Array(1024)

/** the tar operands for `paths` (checked: relative, no `..`), or the whole tree less `exclude` */
export const exportOperands = async (
  dir: string,
  paths: ReadonlyArray<string>,
  exclude: ReadonlyArray<string>
): Promise<ReadonlyArray<string>> => {
  if (paths.length > 0) {
    return paths.map((p) => {
      const parts = safeComponents(p)
      if (typeof parts === "string") throw new Error(`${JSON.stringify(p)}: ${parts}`)
      return parts.length === 0 ? "." : `./${parts.join("/")}`
    })
  }
  const names = await fs.readdir(dir)
  return names
    .filter((name) => !exclude.includes(name))
    .sort()
    .map((name) => `./${name}`)
}

const BLOCK = 512

/** a header's size field: octal digits, or GNU's base-256 (high bit set) for 8 GiB and more */
const headerSize = (header: Uint8Array): number => {
  const field = header.subarray(124, 136)
  if ((field[0]! & 0x80) !== 0) {
    let size = 0
    for (let i = 1; i < field.length; i++) size = size * 256 + field[i]!
    return size
  }
  const text = Buffer.from(field)
    .toString("latin1")
    .replace(/[\0 ]+$/g, "")
    .trim()
  const size = text === "" ? 0 : Number.parseInt(text, 8)
  if (!Number.isFinite(size))
    throw new Error(`tar wrote a header with a bad size field ${JSON.stringify(text)}`)
  return size
}

/**
 * The entries of one tar's output without its end (the zero blocks and the record padding
 * after its last entry), so that several runs' outputs concatenate into one archive. `tar`
 * here is the system's (trusted): its headers are walked, sizes skipped, and the first zero
 * block in a header's place is the end.
 */
class EntriesOnly {
  private pending: Buffer = Buffer.alloc(0)
  /** bytes of entry data (headers' sizes, padded) still to pass before the next header */
  private body = 0
  private ended = false

  /** the part of `chunk` that is entries */
  push(chunk: Buffer): Buffer {
    if (this.ended) return Buffer.alloc(0)
    const out: Array<Buffer> = []
    const data = this.pending.length > 0 ? Buffer.concat([this.pending, chunk]) : chunk
    this.pending = Buffer.alloc(0)
    let at = 0
    while (at < data.length) {
      if (this.body > 0) {
        const take = Math.min(this.body, data.length - at)
        out.push(data.subarray(at, at + take))
        this.body -= take
        at += take
        continue
      }
      if (data.length - at < BLOCK) {
        this.pending = Buffer.from(data.subarray(at))
        break
      }
      const header = data.subarray(at, at + BLOCK)
      if (header.every((byte) => byte === 0)) {
        this.ended = true
        break
      }
      out.push(header)
      at += BLOCK
      this.body = Math.ceil(headerSize(header) / BLOCK) * BLOCK
    }
    return out.length === 1 ? out[0]! : Buffer.concat(out)
  }
}

/** argv operands per tar run (bytes of names): far below Linux's 128 KiB per-string and 2 MiB total */
const BATCH_BYTES = 64 * 1024

/** the operands in runs of at most BATCH_BYTES of names (at least one each) */
const batches = (operands: ReadonlyArray<string>): ReadonlyArray<ReadonlyArray<string>> => {
  const out: Array<Array<string>> = []
  let current: Array<string> = []
  let size = 0
  for (const operand of operands) {
    if (current.length > 0 && size + operand.length + 1 > BATCH_BYTES) {
      out.push(current)
      current = []
      size = 0
    }
    current.push(operand)
    size += operand.length + 1
  }
  if (current.length > 0) out.push(current)
  return out
}

/** one tar run over `operands`, its entries (no end) into `sink`; resolves with their byte count */
const tarRun = async (
  dir: string,
  operands: ReadonlyArray<string>,
  sink: ExportSink,
  options: ExportOptions
): Promise<number> => {
  // cwd, not -C: the child enters the directory before it drops to the user (libuv), so a
  // repository under directories the user cannot traverse (FakeVmm's temp dirs) is readable.
  // The names go in argv, never on stdin: busybox's tar has no -T, and a name may hold a newline
  const child = spawn("tar", ["-c", "-f", "-", ...operands], {
    cwd: dir,
    stdio: ["ignore", "pipe", "pipe"],
    ...(options.user === undefined ? {} : { uid: options.user.uid, gid: options.user.gid })
  })
  let stderr = ""
  child.stderr?.on("data", (chunk: Buffer) => {
    if (stderr.length < 4096) stderr += chunk.toString("utf8")
  })
  const exited = new Promise<number | null>((resolve, reject) => {
    child.once("error", reject)
    child.once("close", (code) => resolve(code))
  })
  const entries = new EntriesOnly()
  let bytes = 0
  try {
    for await (const chunk of child.stdout! as AsyncIterable<Buffer>) {
      const part = entries.push(chunk)
      if (part.length === 0) continue
      bytes += part.length
      await sink.write(part)
    }
  } catch (error) {
    child.kill("SIGKILL")
    await exited.catch(() => undefined)
    throw error
  }
  const code = await exited
  if (code !== 0) throw new Error(`tar exited ${code}: ${stderr.trim()}`)
  return bytes
}

/**
 * Writes the archive of `operands` (relative to `dir`) into `sink`: one tar run per batch of
 * names, their entries concatenated, then the end of the archive. No operand is the archive of
 * nothing (its end alone), which every reader takes as a valid, empty archive. Resolves with
 * its byte count.
 */
export const exportTar = async (
  dir: string,
  operands: ReadonlyArray<string>,
  sink: ExportSink,
  options: ExportOptions = {}
): Promise<number> => {
  let bytes = 0
  for (const batch of batches(operands)) bytes += await tarRun(dir, batch, sink, options)
  await sink.write(END_OF_ARCHIVE)
  await sink.end()
  return bytes + END_OF_ARCHIVE.length
}
