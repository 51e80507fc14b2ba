/**
 * The SDK as a consumer gets it: `npm pack`, the tarball unpacked into a scratch project's
 * node_modules (its dependencies linked from ours: no network), a strict TypeScript consumer
 * type-checked against the shipped declarations, compiled and run (fake backend: a real turn).
 * Needs `npm run build` first (npm test does it): the tarball packs dist/ as it is.
 */
import { afterAll, describe, expect, it } from "@effect/vitest"
import { execFileSync, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"

const repo = path.resolve(import.meta.dirname, "..")
const scratch = fs.mkdtempSync(path.join(os.tmpdir(), "abox-pack-"))
afterAll(() => fs.rmSync(scratch, { recursive: true, force: true }))

const consumer = `
import { dispose, list, open, remove, resume, SessionNotFound, type SessionHandle, type TurnOutcome } from "abox"

const source = process.argv[2]!
const rows = await list()
try {
  await resume("no-such-session")
} catch (error) {
  if (error instanceof SessionNotFound) console.log("typed:", error._tag, error.ref)
}
let id = ""
{
  await using session: SessionHandle = await open({ source })
  id = session.id
  const outcome: TurnOutcome = await session.run("cat hello.txt")
  console.log("turn:", outcome.exitCode, outcome.stdout.trim())
}
await remove(id)
console.log("sessions before:", rows.length, "after:", (await list()).length)
await dispose()
`

describe("the packed SDK in a strict TypeScript project", () => {
  it("npm pack → install → tsc --strict → run", () => {
    expect(
      fs.existsSync(path.join(repo, "dist", "types", "sdk", "index.d.ts")),
      "run npm run build first"
    ).toBe(true)
    const packed = JSON.parse(
      execFileSync("npm", ["pack", "--json", "--pack-destination", scratch], { cwd: repo, encoding: "utf8" })
    ) as Array<{ filename: string }>
    const tarball = path.join(scratch, packed[0]!.filename)

    const project = path.join(scratch, "consumer")
    const installed = path.join(project, "node_modules", "abox")
    fs.mkdirSync(installed, { recursive: true })
    execFileSync("tar", ["-xzf", tarball, "-C", installed, "--strip-components=1"])
    // the package's dependencies (and the consumer's @types/node), linked from ours: no network
    const manifest = JSON.parse(fs.readFileSync(path.join(installed, "package.json"), "utf8")) as {
      dependencies: Record<string, string>
    }
    for (const dep of [...Object.keys(manifest.dependencies), "@types/node"]) {
      const link = path.join(project, "node_modules", dep)
      fs.mkdirSync(path.dirname(link), { recursive: true })
      fs.symlinkSync(path.join(repo, "node_modules", dep), link)
    }
    fs.writeFileSync(
      path.join(project, "package.json"),
      JSON.stringify({ name: "consumer", private: true, type: "module", dependencies: { abox: "0.1.0" } })
    )
    fs.writeFileSync(
      path.join(project, "tsconfig.json"),
      JSON.stringify({
        compilerOptions: {
          target: "ES2022",
          module: "NodeNext",
          moduleResolution: "NodeNext",
          lib: ["ES2023", "ESNext.Disposable"],
          types: ["node"],
          strict: true,
          exactOptionalPropertyTypes: true,
          noImplicitAny: true,
          outDir: "out"
        },
        files: ["index.ts"]
      })
    )
    fs.writeFileSync(path.join(project, "index.ts"), consumer)

    const tsc = spawnSync(
      process.execPath,
      [path.join(repo, "node_modules", "typescript", "bin", "tsc"), "-p", project],
      {
        encoding: "utf8"
      }
    )
    expect(tsc.stdout + tsc.stderr).toBe("")
    expect(tsc.status).toBe(0)

    const source = path.join(scratch, "source")
    fs.mkdirSync(source)
    fs.writeFileSync(path.join(source, "hello.txt"), "hello from the host\n")
    const run = spawnSync(process.execPath, [path.join(project, "out", "index.js"), source], {
      cwd: project,
      env: {
        PATH: process.env.PATH ?? "",
        HOME: scratch,
        ABOX_HOME: path.join(scratch, "home"),
        ABOX_VMM: "fake"
      },
      encoding: "utf8",
      timeout: 120_000
    })
    expect(run.stderr).toBe("")
    expect(run.stdout).toBe(
      "typed: SessionNotFound no-such-session\nturn: 0 hello from the host\nsessions before: 0 after: 0\n"
    )
    expect(run.status).toBe(0)
  }, 240_000)
})
