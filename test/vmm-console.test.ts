import { describe, expect, it } from "@effect/vitest"
import * as fc from "fast-check"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { BoundedConsole, consoleTail } from "../src/vmm/console.js"

describe("bounded console.log", () => {
  it("never exceeds its bound and always ends with the most recent bytes", () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-console-"))
    fc.assert(
      fc.property(
        fc.integer({ min: 16, max: 512 }),
        fc.array(fc.uint8Array({ maxLength: 300 }), { maxLength: 40 }),
        (max, chunks) => {
          const file = path.join(dir, "console.log")
          fs.rmSync(file, { force: true })
          const c = new BoundedConsole(file, max)
          let all = Buffer.alloc(0)
          for (const chunk of chunks) {
            c.write(Buffer.from(chunk))
            all = Buffer.concat([all, chunk])
            expect(fs.statSync(file).size).toBeLessThanOrEqual(max)
          }
          c.close()
          const kept = fs.readFileSync(file)
          // what is kept is a suffix of everything written, and at least half the bound of it (when there was that much)
          expect(all.subarray(all.length - kept.length).equals(kept)).toBe(true)
          expect(kept.length).toBeGreaterThanOrEqual(Math.min(all.length, Math.floor(max / 2)))
          expect(fs.statSync(file).mode & 0o777).toBe(0o600)
        }
      )
    )
    fs.rmSync(dir, { recursive: true, force: true })
  })

  it("a later boot appends after a marker: earlier boots are kept, within the bound", () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-console-"))
    const file = path.join(dir, "console.log")
    const first = new BoundedConsole(file, 4096)
    first.write(Buffer.from("first boot\n"))
    first.close()
    const second = new BoundedConsole(file, 4096)
    second.write(Buffer.from("second boot\n"))
    second.close()
    expect(fs.readFileSync(file, "utf8")).toMatch(/^first boot\n\n--- abox: boot at \S+ ---\nsecond boot\n$/)
    const third = new BoundedConsole(file, 64)
    third.write(Buffer.from("x".repeat(100)))
    third.close()
    expect(fs.statSync(file).size).toBeLessThanOrEqual(64)
    fs.rmSync(dir, { recursive: true, force: true })
  })

  it("consoleTail: the last n non-empty lines, escape sequences removed", () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-console-"))
    const file = path.join(dir, "console.log")
    fs.writeFileSync(file, "\x1b[2Jone\r\ntwo\n\nthree\nfour\n")
    expect(consoleTail(file, 3)).toEqual(["two", "three", "four"])
    expect(consoleTail(path.join(dir, "missing"), 3)).toEqual([])
    fs.rmSync(dir, { recursive: true, force: true })
  })
})
