/** `abox logs`: the guest console made safe for a terminal; -f on a stopped session ends */
import { describe, expect, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as path from "node:path"
import { runCli, tempHome, withCliAndSource, writeSession } from "./cliHelpers.js"

withCliAndSource()

describe("abox logs", () => {
  it("strips the console's terminal control sequences unless --raw; -f on a stopped session ends and says so", () => {
    const home = tempHome()
    const A = "01aaaaaaaaaaaaaaaaaaaaaaaa"
    const dir = writeSession(path.join(home, "sessions"), A)
    const raw =
      "\u001b[2J\u001b[H\u001b[?7lLinux version 6.1\r\n\u001b]0;title\u0007\u001b[1;31mabox-init\u001b[0m: ready\n"
    fs.writeFileSync(path.join(dir, "console.log"), raw)
    const clean = runCli(home, ["logs", A])
    expect(clean.code).toBe(0)
    expect(clean.stdout).toBe("Linux version 6.1\nabox-init: ready\n")
    expect(runCli(home, ["logs", "--raw", A]).stdout).toBe(raw)
    const followed = runCli(home, ["logs", "-f", A])
    expect(followed.code).toBe(0)
    expect(followed.stdout).toBe("Linux version 6.1\nabox-init: ready\n")
    expect(followed.stderr).toContain("is not running")
    expect(followed.stderr).not.toContain("closing")
  })
})
