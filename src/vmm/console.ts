// Raw node:fs: the console writer appends synchronously from a stream callback and rewrites
// the file in place when it outgrows its bound; it runs inside the helper, outside any Effect.
import * as fs from "node:fs"
import * as path from "node:path"

/**
 * console.log with a bound, kept across boots (a new boot appends after a marker line): bytes are
 * appended as they come; when the file would pass
 * `maxBytes`, it is rewritten to hold only the most recent `maxBytes / 2` bytes (kept in
 * memory), so the tail — what a failed boot needs — always survives, and the file never
 * exceeds `maxBytes`. Amortised cost: one rewrite per `maxBytes / 2` bytes of output.
 */
export class BoundedConsole {
  private fd: number
  private size = 0
  private tail: Buffer = Buffer.alloc(0)
  private readonly keep: number

  constructor(
    readonly file: string,
    readonly maxBytes: number
  ) {
    this.keep = Math.max(1, Math.floor(maxBytes / 2))
    // earlier boots stay (within the bound), each boot after the first behind a marker line
    this.fd = fs.openSync(file, fs.constants.O_RDWR | fs.constants.O_CREAT, 0o600)
    fs.fchmodSync(this.fd, 0o600)
    const existing = fs.fstatSync(this.fd).size
    if (existing > 0) {
      const length = Math.min(existing, this.keep)
      const tail = Buffer.alloc(length)
      fs.readSync(this.fd, tail, 0, length, existing - length)
      this.tail = tail
      this.size = existing
      this.write(Buffer.from(`\n--- abox: boot at ${new Date().toISOString()} ---\n`))
    }
  }

  write(chunk: Buffer): void {
    if (this.fd < 0) return
    const joined = Buffer.concat([this.tail, chunk])
    this.tail = joined.length > this.keep ? joined.subarray(joined.length - this.keep) : joined
    if (this.size + chunk.length > this.maxBytes) {
      fs.ftruncateSync(this.fd, 0)
      fs.writeSync(this.fd, this.tail, 0, this.tail.length, 0)
      this.size = this.tail.length
      return
    }
    fs.writeSync(this.fd, chunk, 0, chunk.length, this.size)
    this.size += chunk.length
  }

  close(): void {
    if (this.fd < 0) return
    fs.closeSync(this.fd)
    this.fd = -1
  }
}

/** the last `n` non-empty lines of a console log (for close outcomes and error messages) */
export const consoleTail = (file: string, n: number): Array<string> => {
  try {
    const stat = fs.statSync(file)
    const length = Math.min(stat.size, 64 * 1024)
    const buffer = Buffer.alloc(length)
    const fd = fs.openSync(file, "r")
    try {
      fs.readSync(fd, buffer, 0, length, stat.size - length)
    } finally {
      fs.closeSync(fd)
    }
    return buffer
      .toString("utf8")
      .split(/\r?\n/)
      .map((line) => line.replace(/\x1b\[[0-9;?]*[A-Za-z]/g, "").trimEnd())
      .filter((line) => line.length > 0)
      .slice(-n)
  } catch {
    return []
  }
}

/**
 * Why a VM that ended before its guest said hello ended, as far as its logs tell: the last lines
 * of the guest console and, where the VMM keeps its own log apart (vfkit.log), of that log (under
 * Virtualization.framework the console of a VM that failed to start is empty; vfkit's stderr
 * holds the reason). `clean` makes each line safe to print.
 */
export const earlyExitReport = (
  consoleLog: string,
  vmmLog: string | undefined,
  clean: (line: string) => string,
  n = 5
): string => {
  const parts: Array<string> = []
  const console = consoleTail(consoleLog, n).map(clean)
  if (console.length > 0) parts.push(`its console ended: ${console.join(" | ")}`)
  if (vmmLog !== undefined && vmmLog !== consoleLog) {
    const own = consoleTail(vmmLog, n).map(clean)
    if (own.length > 0) parts.push(`${path.basename(vmmLog)} ended: ${own.join(" | ")}`)
  }
  return parts.length > 0 ? parts.join("; ") : `its console (${consoleLog}) is empty`
}
