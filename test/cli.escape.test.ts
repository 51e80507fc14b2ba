/**
 * What abox prints about a session or an image shows control characters as escapes instead of
 * passing them to the terminal: a source path or a session directory's name holding ESC, BEL
 * and a newline stays one row of `list`, one line of `show`, one `abox:` error line, one
 * `image list` problem, one `rm` line (the built CLI, in processes).
 */
import { describe, expect, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as path from "node:path"
import { exitCodeFor } from "../src/cli/exitCodes.js"
import { runCli, tempHome, withCliAndSource, writeSession } from "./cliHelpers.js"

withCliAndSource()

/** an OSC title (ended by BEL), a newline and a screen clear */
const evil = "x\u001b]0;owned\u0007\n\u001b[2Jy"
const escaped = "x\\e]0;owned\\x07\\n\\e[2Jy"
const CONTROL = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f]/

describe("names and paths on the terminal", () => {
  it("list, show, an error quoting a name, image list and rm escape ESC, BEL and newlines", () => {
    const home = tempHome()
    const sessions = path.join(home, "sessions")
    const id = "01aaaaaaaaaaaaaaaaaaaaaaaa"
    writeSession(sessions, id, { source: `/src/${evil}` })
    // a legacy-shaped id is any directory name: this one holds the same characters
    const oddId = `odd${evil}`
    writeSession(sessions, oddId, "not json")

    const list = runCli(home, ["list"])
    expect(list.code, list.stderr).toBe(0)
    expect(list.stdout).not.toMatch(CONTROL)
    const rows = list.stdout.trimEnd().split("\n")
    expect(rows).toHaveLength(3) // the header and one row per session
    expect(rows.find((r) => r.startsWith(id))).toContain(`/src/${escaped}`)
    expect(rows.find((r) => r.startsWith("odd"))).toMatch(/^odd\S*\s.*CORRUPT/)
    expect(list.stdout).toContain(`odd${escaped}`)

    const show = runCli(home, ["show", id])
    expect(show.code, show.stderr).toBe(0)
    expect(show.stdout).not.toMatch(CONTROL)
    expect(show.stdout).toMatch(
      new RegExp(`^source: +/src/${escaped.replaceAll("\\", "\\\\").replaceAll("[", "\\[")}$`, "m")
    )

    // the ref is quoted in SessionNotFound's message: one line, escaped
    const missing = runCli(home, ["show", `no${evil}`])
    expect(missing.code).toBe(exitCodeFor("SessionNotFound"))
    expect(missing.stderr).toMatch(/^abox: [^\n]+\n$/)
    expect(missing.stderr).not.toMatch(CONTROL)
    // (an error line joins a message's lines with a space, as for a multi-line schema error)
    expect(missing.stderr).toContain(`no${escaped.replace("\\n", " ")}`)

    // an image directory without image.json: its path is in a problem line
    fs.mkdirSync(path.join(home, "images", `img${evil}`, "0123456789abcdef"), { recursive: true })
    const images = runCli(home, ["image", "list"])
    expect(images.code, images.stderr).toBe(0)
    expect(images.stderr).not.toMatch(CONTROL)
    expect(images.stderr).toContain(`img${escaped}`)
    expect(images.stderr.trimEnd().split("\n")).toHaveLength(1)

    const rm = runCli(home, ["rm", "--yes", id, oddId])
    expect(rm.code, rm.stderr).toBe(0)
    expect(rm.stdout).not.toMatch(CONTROL)
    expect(rm.stdout).toBe(`removed ${id}\nremoved odd${escaped}\n`)
  })
})
