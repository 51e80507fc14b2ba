import * as Effect from "effect/Effect"
import type { TransferProgress } from "../programs/session.js"

const mb = (bytes: number) => `${(bytes / 1e6).toFixed(1)} MB`

/** one line of a transfer's progress: a bar, files and bytes */
export const progressLine = (p: TransferProgress, width = 24): string => {
  const fraction = p.totalBytes > 0 ? Math.min(1, p.bytes / p.totalBytes) : p.files >= p.totalFiles ? 1 : 0
  const filled = Math.round(fraction * width)
  return (
    `  [${"#".repeat(filled)}${"-".repeat(width - filled)}] ` +
    `${p.files}/${p.totalFiles} files, ${mb(p.bytes)}/${mb(p.totalBytes)}`
  )
}

/** the repository transfer's progress on stderr: redrawn in place on a terminal, else the last line only */
export const progressBar = (enabled: boolean) => (p: TransferProgress) =>
  Effect.sync(() => {
    if (!enabled) return
    const done = p.bytes >= p.totalBytes && p.files >= p.totalFiles
    if (process.stderr.isTTY === true) process.stderr.write(`\r${progressLine(p)}${done ? "\n" : ""}`)
    else if (done) process.stderr.write(`${progressLine(p)}\n`)
  })
