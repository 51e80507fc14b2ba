import { afterAll, beforeAll } from "@effect/vitest"
import { build } from "esbuild"
import { spawn, spawnSync } from "node:child_process"
import { createHash } from "node:crypto"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"

const repo = path.resolve(import.meta.dirname, "..")
/** the CLI bundled the way scripts/build.mjs does it, under .build/ so that tests never race `npm run build` */
export const cliBundle = path.join(repo, ".build", "cli-test", "abox.js")

export const buildCli = async () => {
  await build({
    entryPoints: [path.join(repo, "src/bin.ts")],
    outfile: cliBundle,
    bundle: true,
    platform: "node",
    target: "node20",
    format: "esm",
    external: ["fs-native-extensions", "require-addon"],
    banner: {
      js: "import { createRequire as __abox_createRequire } from 'node:module'; const require = __abox_createRequire(import.meta.url);"
    },
    logLevel: "error"
  })
}

export interface Run {
  readonly code: number | null
  readonly stdout: string
  readonly stderr: string
}

export const runCli = (home: string, args: ReadonlyArray<string>, env: Record<string, string> = {}): Run => {
  const r = spawnSync(process.execPath, [cliBundle, ...args], {
    env: { PATH: process.env.PATH ?? "", HOME: path.join(home, "user"), ABOX_HOME: home, ...env },
    // stdin is not a terminal here: what `rm` sees in scripts
    stdio: ["ignore", "pipe", "pipe"],
    encoding: "utf8",
    timeout: 30_000
  })
  return { code: r.status, stdout: r.stdout, stderr: r.stderr }
}

const homes: Array<string> = []
export const tempHome = () => {
  const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-cli-"))
  homes.push(home)
  return home
}
export const removeTempHomes = () => {
  for (const home of homes.splice(0)) fs.rmSync(home, { recursive: true, force: true })
}

/** write a session directory as abox does (the on-disk contract: 0700 dir, 0600 session.json) */
export const writeSession = (
  sessionsDir: string,
  id: string,
  meta: Record<string, unknown> | string = {}
): string => {
  const dir = path.join(sessionsDir, id)
  fs.mkdirSync(dir, { recursive: true, mode: 0o700 })
  const body =
    typeof meta === "string"
      ? meta
      : JSON.stringify({
          format: 1,
          id,
          created: "2026-01-01T00:00:00.000Z",
          source: `/src/${id}`,
          model: "default",
          ...meta
        })
  fs.writeFileSync(path.join(dir, "session.json"), body, { mode: 0o600 })
  return dir
}

export interface CliExit {
  readonly code: number | null
  readonly signal: NodeJS.Signals | null
  readonly stdout: string
  readonly stderr: string
  /** when it exited (Date.now()) */
  readonly at: number
}

/** start `node <bundle> …args` without waiting: its exit, and a wait for text on its stdout */
export const startCli = (bundle: string, args: ReadonlyArray<string>, env: Record<string, string>) => {
  const child = spawn(process.execPath, [bundle, ...args], { env, stdio: ["ignore", "pipe", "pipe"] })
  let stdout = ""
  let stderr = ""
  child.stdout.on("data", (d: Buffer) => (stdout += d.toString()))
  child.stderr.on("data", (d: Buffer) => (stderr += d.toString()))
  const exited = new Promise<CliExit>((resolve) =>
    child.on("exit", (code, signal) => resolve({ code, signal, stdout, stderr, at: Date.now() }))
  )
  const waitFor = (stream: "stdout" | "stderr", text: string, timeoutMs: number) =>
    new Promise<void>((resolve, reject) => {
      const seen = () => (stream === "stdout" ? stdout : stderr)
      const timer = setTimeout(
        () => reject(new Error(`never saw ${text}; stdout: ${stdout}; stderr: ${stderr}`)),
        timeoutMs
      )
      const check = () => {
        if (seen().includes(text)) {
          clearTimeout(timer)
          resolve()
        }
      }
      child[stream].on("data", check)
      check()
    })
  const sees = (text: string, timeoutMs = 300_000) => waitFor("stdout", text, timeoutMs)
  const seesOnStderr = (text: string, timeoutMs = 300_000) => waitFor("stderr", text, timeoutMs)
  return { child, exited, sees, seesOnStderr }
}

/** sha256 of every regular file directly in `dir` (except those named in `skip`) */
export const fileChecksums = (dir: string, skip: ReadonlyArray<string> = []) =>
  Object.fromEntries(
    fs
      .readdirSync(dir)
      .filter((f) => !skip.includes(f) && fs.statSync(path.join(dir, f)).isFile())
      .map((f) => [
        f,
        createHash("sha256")
          .update(fs.readFileSync(path.join(dir, f)))
          .digest("hex")
      ])
  )

/** the first `n` of `racers` to exit, each with its exit */
export const firstExits = <R extends { readonly exited: Promise<CliExit> }>(
  racers: ReadonlyArray<R>,
  n: number
) =>
  new Promise<Array<{ readonly racer: R; readonly code: number | null }>>((resolve) => {
    const done: Array<{ readonly racer: R; readonly code: number | null }> = []
    for (const racer of racers) {
      void racer.exited.then((exit) => {
        done.push({ racer, code: exit.code })
        if (done.length === n) resolve(done)
      })
    }
  })

/**
 * The usual set-up of a CLI test file: the bundle built once, a small source repository, the
 * temp homes removed afterwards. Returns a getter for the source (set once beforeAll has run).
 */
export const withCliAndSource = (): (() => string) => {
  let source = ""
  beforeAll(async () => {
    await buildCli()
    source = tempHome()
    fs.writeFileSync(path.join(source, "README.md"), "hello\n")
  }, 120_000)
  afterAll(() => removeTempHomes())
  return () => source
}
