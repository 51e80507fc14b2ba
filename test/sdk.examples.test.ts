/** The SDK's documented examples (examples/sdk, docs/sdk.md) run as written, over the fake backend. */
import { afterAll, describe, expect, it } from "@effect/vitest"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"

const repo = path.resolve(import.meta.dirname, "..")
const built = fs.existsSync(path.join(repo, "dist", "sdk.js"))
const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-examples-"))
afterAll(() => fs.rmSync(home, { recursive: true, force: true }))

const runExample = (file: string) =>
  spawnSync(process.execPath, [path.join(repo, "examples", "sdk", file)], {
    env: { PATH: process.env.PATH ?? "", HOME: home, ABOX_HOME: home, ABOX_VMM: "fake" },
    encoding: "utf8",
    timeout: 60_000
  })

describe.skipIf(!built)("SDK examples (built dist/sdk.js; `npm test` builds it)", () => {
  it("open-turn.mjs streams the example repo's greeting and closes", () => {
    const r = runExample("open-turn.mjs")
    expect(r.status).toBe(0)
    expect(r.stdout).toMatch(/^hello from .*in .*repo\n$/)
    expect(r.stderr).toContain("exit 0")
  })

  it("manager.mjs resumes by name and finds its note", () => {
    const r = runExample("manager.mjs")
    expect(r.status).toBe(0)
    expect(r.stdout).toContain("after resume: remembered")
  })

  it("effect.mjs runs the open program in a scope", () => {
    const r = runExample("effect.mjs")
    expect(r.status).toBe(0)
    expect(r.stdout.split("\n")).toEqual(expect.arrayContaining(["README.md", "greet.sh"]))
  })
})
