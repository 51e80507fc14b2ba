/**
 * `abox logs --broker` through the built CLI: the log is streamed, both parts of a rotated log
 * are printed, and guest-chosen text cannot drive the terminal.
 */
import { describe, expect, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as path from "node:path"
import { hasControl } from "../src/lib/text.js"
import { runCli, tempHome, withCliAndSource } from "./cliHelpers.js"

const fake = { ABOX_VMM: "fake" }
const sourceDir = withCliAndSource()

describe("abox logs --broker", () => {
  it("prints rotated and current parts, with control characters escaped", () => {
    const home = tempHome()
    const r = runCli(home, ["run", "--json", sourceDir(), "--", "echo", "hi"], fake)
    expect(r.code, r.stderr).toBe(0)
    const id = (JSON.parse(r.stdout.split("\n")[0]!) as { session: string }).session
    const dir = path.join(home, "sessions", id)
    const line = (channel: number, host: string) =>
      JSON.stringify({
        time: "2026-01-01T00:00:00.000Z",
        channel,
        event: "open",
        host,
        port: 443,
        decision: "deny",
        reason: "invalid-host",
        credential: false
      }) + "\n"
    fs.writeFileSync(path.join(dir, "broker.log.1"), line(1, "old.example"), { mode: 0o600 })
    fs.writeFileSync(
      path.join(dir, "broker.log"),
      line(2, "evil\u001b]0;title\u0007\u001b[2J\u009b1m\b\b\rallowed.example"),
      { mode: 0o600 }
    )
    const out = runCli(home, ["logs", id, "--broker"], fake)
    expect(out.code, out.stderr).toBe(0)
    const lines = out.stdout.trimEnd().split("\n")
    expect(lines).toHaveLength(2)
    expect(lines[0]).toContain("old.example:443")
    expect(hasControl(out.stdout.replaceAll("\n", ""))).toBe(false)
    expect(lines[1]).toContain("evil\\e]0;title\\x07\\e[2J\\x9b1m\\b\\b\\rallowed.example:443")
  })
})
