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
  const child = spawn("tar", ["-c", "-f", "-", ...operands], {
    cwd: dir,
    stdio: ["ignore", "pipe", "pipe"],
    ...(options.user === undefined ? {} : { uid: options.user.uid, gid: options.user.gid })
  })
  let stderr = ""
  child.stderr.on("data", (chunk: Buffer) => {
    if (stderr.length < 4096) stderr += chunk.toString("utf8")
  })
  const exited = new Promise<number | null>((resolve, reject) => {
    child.once("error", reject)
    child.once("close", (code) => resolve(code))
  })
  let bytes = 0
  try {
    for await (const chunk of child.stdout as AsyncIterable<Buffer>) {
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
