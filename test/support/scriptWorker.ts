/** Small helpers for tests that drive real node processes line by line. */
import * as Effect from "effect/Effect"
import { type ChildProcess, spawn } from "node:child_process"
import * as path from "node:path"
import { createInterface } from "node:readline"
import { build } from "esbuild"

const ROOT = path.resolve(import.meta.dirname, "..", "..")

export interface Worker {
  readonly child: ChildProcess
  /** the next stdout line, in order */
  readonly line: Effect.Effect<string, Error>
  /** completes when stdout has closed: the worker and every process that inherited its stdout are gone */
  readonly closed: Effect.Effect<void>
  readonly exited: Effect.Effect<{ readonly code: number | null; readonly signal: NodeJS.Signals | null }>
}

/**
 * Bundles a test script once (esbuild, like scripts/build.mjs) so that many processes start in
 * tens of milliseconds instead of each compiling TypeScript through tsx. The bundle lives under
 * node_modules/.cache so the external native addon resolves.
 */
export const bundleScript = (script: string) =>
  Effect.promise(async () => {
    const outfile = path.join(
      ROOT,
      "node_modules",
      ".cache",
      "abox-tests",
      `${path.basename(script, ".ts")}.mjs`
    )
    await build({
      entryPoints: [path.join(ROOT, script)],
      outfile,
      bundle: true,
      platform: "node",
      target: "node20",
      format: "esm",
      external: ["fs-native-extensions", "require-addon"],
      logLevel: "warning"
    })
    return outfile
  })

/** `node <bundle> ...args` (from `bundleScript`), stdin and stdout piped, stderr inherited */
export const startScript = (bundle: string, args: ReadonlyArray<string>): Worker => {
  const script = path.basename(bundle)
  const child = spawn(process.execPath, [bundle, ...args], {
    cwd: ROOT,
    stdio: ["pipe", "pipe", "inherit"]
  })
  const buffered: Array<string> = []
  const waiting: Array<(line: string | undefined) => void> = []
  let ended = false
  const lines = createInterface({ input: child.stdout! })
  lines.on("line", (line) => {
    const next = waiting.shift()
    if (next) next(line)
    else buffered.push(line)
  })
  const stdoutClosed = new Promise<void>((resolve) => {
    lines.once("close", () => {
      ended = true
      for (const next of waiting.splice(0)) next(undefined)
      resolve()
    })
  })
  const exited = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) => {
    child.once("exit", (code, signal) => resolve({ code, signal }))
  })
  const line = Effect.async<string, Error>((resume) => {
    const first = buffered.shift()
    if (first !== undefined) return resume(Effect.succeed(first))
    if (ended) return resume(Effect.fail(new Error(`${script}: stdout closed`)))
    waiting.push((value) =>
      resume(value === undefined ? Effect.fail(new Error(`${script}: stdout closed`)) : Effect.succeed(value))
    )
  })
  return {
    child,
    line,
    closed: Effect.promise(() => stdoutClosed),
    exited: Effect.promise(() => exited)
  }
}

/** kill what is still running (a test's finalizer) */
export const killAll = (workers: ReadonlyArray<Worker>) =>
  Effect.sync(() => {
    for (const worker of workers) {
      if (worker.child.exitCode === null && worker.child.signalCode === null) worker.child.kill("SIGKILL")
    }
  })
