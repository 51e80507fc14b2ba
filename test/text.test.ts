import { describe, expect, it } from "@effect/vitest"
import { escapeControl, hasControl } from "../src/lib/text.js"

describe("escapeControl", () => {
  it("makes terminal control sequences visible", () => {
    expect(escapeControl("a\u001b[2Jb")).toBe("a\\e[2Jb")
    expect(escapeControl("x\u009b31my")).toBe("x\\x9b31my")
    expect(escapeControl("ok\b\b\bno")).toBe("ok\\b\\b\\bno")
    expect(escapeControl("a\rb\u0000c\u007f")).toBe("a\\rb\\x00c\\x7f")
    expect(escapeControl("evil\u202etxt.exe")).toBe("evil\\u{202e}txt.exe")
    expect(escapeControl("line\nnext\tx")).toBe("line\\nnext\\tx")
  })

  it("keeps printable text, and newlines and tabs when asked", () => {
    expect(escapeControl("api.example.com ü 日本 ✓")).toBe("api.example.com ü 日本 ✓")
    expect(escapeControl("line\nnext\tx\u001b", { keepNewlines: true })).toBe("line\nnext\tx\\e")
  })

  it("leaves no control character behind", () => {
    let all = ""
    for (let c = 0; c < 0x3000; c++) all += String.fromCodePoint(c)
    expect(hasControl(all)).toBe(true)
    expect(hasControl(escapeControl(all))).toBe(false)
    expect(hasControl(escapeControl(all))).toBe(false)
  })
})
