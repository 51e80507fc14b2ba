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

/**
 * The step display, on stderr: each phase of a long action (Open/Resume, `abox image build`) as
 * it runs. On a terminal the running phase shows its elapsed time live (rewritten in place), then
 * the time it took; otherwise one plain line as each phase begins and one as it ends. The phase
 * `ready` ends the last one. Scoped: a phase cut short by a failure still ends its line.
 */
export const stepDisplay = <Phase extends string>(
  enabled: boolean,
  live: boolean = process.stderr.isTTY === true
) =>
  Effect.gen(function* () {
    let current: { readonly phase: Phase; readonly started: number } | undefined
    let ticker: NodeJS.Timeout | undefined
    const line = (c: { readonly phase: Phase; readonly started: number }) =>
      `  ${c.phase.padEnd(9)} ${((Date.now() - c.started) / 1000).toFixed(2)}s`
    const finish = (ok: boolean) => {
      if (ticker !== undefined) clearInterval(ticker)
      ticker = undefined
      if (current !== undefined && enabled) {
        process.stderr.write(live ? `\r${line(current)}${ok ? "" : " (failed)"}\n` : `${line(current)}\n`)
      }
      current = undefined
    }
    yield* Effect.addFinalizer(() => Effect.sync(() => finish(false)))
    return (next: Phase | "ready") =>
      Effect.sync(() => {
        finish(true)
        if (next === "ready") return
        const started = { phase: next, started: Date.now() }
        current = started
        if (!enabled) return
        if (live) {
          process.stderr.write(line(started))
          ticker = setInterval(() => process.stderr.write(`\r${line(started)}`), 250)
          ticker.unref()
        } else process.stderr.write(`  ${next} …\n`)
      })
  })
