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
import * as fs from "node:fs/promises"
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

/** every non-directory entry under `dir` (less top-level `exclude`), by relative path */
const walkEntries = async (dir: string, exclude: ReadonlyArray<string>): Promise<Map<string, EntryStat>> => {
  const out = new Map<string, EntryStat>()
  const pending = [""]
  while (pending.length > 0) {
    const rel = pending.pop()!
    let names: Array<string>
    try {
      names = await fs.readdir(rel === "" ? dir : `${dir}/${rel}`)
    } catch {
      continue
    }
    for (const name of names) {
      if (rel === "" && exclude.includes(name)) continue
      const relPath = rel === "" ? name : `${rel}/${name}`
      const full = `${dir}/${relPath}`
      const stat = await fs.lstat(full, { bigint: true })
      if (stat.isDirectory()) {
        pending.push(relPath)
        continue
      }
      const kind = stat.isFile() ? "file" : stat.isSymbolicLink() ? "link" : "other"
      out.set(relPath, {
        kind,
        mode: stat.mode,
        size: stat.size,
        mtimeNs: stat.mtimeNs,
        ctimeNs: stat.ctimeNs,
        ...(kind === "link" ? { target: await fs.readlink(full) } : {})
      })
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

/** two zero blocks: the archive of nothing */
const EMPTY_TAR = new Uint8Array(1024)

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

/** writes the archive into `sink`; resolves with its byte count */
export const exportTar = async (
  dir: string,
  operands: ReadonlyArray<string>,
  sink: ExportSink,
  options: ExportOptions = {}
): Promise<number> => {
  if (operands.length === 0) {
    await sink.write(EMPTY_TAR)
    await sink.end()
    return EMPTY_TAR.length
  }
  // cwd, not -C: the child enters the directory before it drops to the user (libuv), so a
  // repository under directories the user cannot traverse (FakeVmm's temp dirs) is readable
  // many operands (a changed set) go on stdin (-T -): no argv limit
  const fromStdin = operands.length > 64
  if (fromStdin && operands.some((operand) => operand.includes("\n"))) {
    throw new Error("a file name holds a newline: it cannot be listed for tar")
  }
  const child = spawn("tar", ["-c", "-f", "-", ...(fromStdin ? ["-T", "-"] : operands)], {
    cwd: dir,
    stdio: [fromStdin ? "pipe" : "ignore", "pipe", "pipe"],
    ...(options.user === undefined ? {} : { uid: options.user.uid, gid: options.user.gid })
  })
  if (fromStdin) {
    child.stdin?.on("error", () => undefined)
    child.stdin?.end(operands.join("\n") + "\n")
  }
  let stderr = ""
  child.stderr?.on("data", (chunk: Buffer) => {
    if (stderr.length < 4096) stderr += chunk.toString("utf8")
  })
  const exited = new Promise<number | null>((resolve, reject) => {
    child.once("error", reject)
    child.once("close", (code) => resolve(code))
  })
  let bytes = 0
  try {
    for await (const chunk of child.stdout! as AsyncIterable<Buffer>) {
      bytes += chunk.length
      await sink.write(chunk)
    }
  } catch (error) {
    child.kill("SIGKILL")
    throw error
  }
  const code = await exited
  if (code !== 0) throw new Error(`tar exited ${code}: ${stderr.trim()}`)
  await sink.end()
  return bytes
}
