/** `abox open` with turns piped on stdin (`!cmd`: shell turns): the exit status is the last failed turn's */
import { describe, expect, it } from "@effect/vitest"
import { spawnSync } from "node:child_process"
import * as path from "node:path"
import { cliBundle, tempHome, withCliAndSource } from "./cliHelpers.js"

const sourceDir = withCliAndSource()

const openWith = (home: string, input: string) =>
  spawnSync(process.execPath, [cliBundle, "open", sourceDir()], {
    env: { PATH: process.env.PATH ?? "", HOME: path.join(home, "user"), ABOX_HOME: home, ABOX_VMM: "fake" },
    input,
    encoding: "utf8",
    timeout: 120_000
  })

describe("piped turns", () => {
  it("exit with the last failed turn's status; 0 when every turn succeeded", () => {
    const home = tempHome()
    const failed = openWith(home, "!exit 3\n!echo ok\n")
    expect(failed.stdout).toBe("ok\n")
    expect(failed.status).toBe(3)
    expect(openWith(home, "!echo a\n!echo b\n").status).toBe(0)
  })
})

describe("progress", () => {
  it("each phase is shown as it begins, then with the time it took (plain lines when stderr is not a terminal)", () => {
    const home = tempHome()
    const r = openWith(home, "!true\n")
    expect(r.status).toBe(0)
    for (const phase of ["snapshot", "clone", "config", "boot", "transfer"]) {
      expect(r.stderr).toMatch(new RegExp(`  ${phase} …\\n[^]*  ${phase}\\s+\\d+\\.\\d\\ds\\n`))
    }
  })
})
