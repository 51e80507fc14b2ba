import { describe, expect, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as path from "node:path"
import { exitCodeByTag, exitCodeFor, UNKNOWN_ERROR_EXIT } from "../src/cli/exitCodes.js"

const doc = fs.readFileSync(path.join(import.meta.dirname, "..", "docs", "exit-codes.md"), "utf8")

/** rows of the table: | `Tag` | code | … */
const documented = (): Map<string, number> => {
  const rows = new Map<string, number>()
  for (const m of doc.matchAll(/^\|\s*`([A-Za-z]+)`\s*\|\s*(\d+)\s*\|/gm)) {
    expect(rows.has(m[1]!), `${m[1]} documented twice`).toBe(false)
    rows.set(m[1]!, Number(m[2]))
  }
  return rows
}

describe("exit codes", () => {
  it("docs/exit-codes.md and src/cli/exitCodes.ts agree, tag by tag", () => {
    expect(Object.fromEntries(documented())).toEqual(exitCodeByTag)
  })

  it("the unknown-error code and success are documented", () => {
    expect(doc).toMatch(new RegExp(`^\\|\\s*\\(anything else\\)\\s*\\|\\s*${UNKNOWN_ERROR_EXIT}\\s*\\|`, "m"))
    expect(doc).toMatch(/^\|\s*\(success\)\s*\|\s*0\s*\|/m)
  })

  it("codes are distinct (but for usage), in 64..119 (99 is the fallback), and unknown tags get the fallback", () => {
    // distinct, except the usage code: ConfigInvalid and InvalidOption are usage errors (64) with tags of their own
    const codes = Object.values(exitCodeByTag).filter((code) => code !== exitCodeByTag.ValidationError)
    expect(new Set(codes).size).toBe(codes.length)
    for (const code of codes) {
      expect(code).toBeGreaterThanOrEqual(64)
      expect(code).toBeLessThanOrEqual(119)
      expect(code).not.toBe(UNKNOWN_ERROR_EXIT)
    }
    expect(exitCodeFor("NoSuchTag")).toBe(UNKNOWN_ERROR_EXIT)
  })
})
