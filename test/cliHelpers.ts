import { build } from "esbuild"
import { spawnSync } from "node:child_process"
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
