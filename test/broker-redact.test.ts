import { describe, expect, it } from "@effect/vitest"
import { Readable } from "node:stream"
import { redactText, SecretRedactor, secretNeedles } from "../src/broker/redact.js"

const SECRET = "sk-canary-0123456789abcdef"

/** the chunks the redactor emits for `chunks` written one by one */
const run = async (needles: ReadonlyArray<string>, chunks: ReadonlyArray<string>) => {
  const redactor = new SecretRedactor(secretNeedles(needles))
  const out: Array<string> = []
  redactor.on("data", (c: Buffer) => out.push(c.toString("latin1")))
  const done = new Promise<void>((resolve) => redactor.on("end", () => resolve()))
  Readable.from(chunks.map((c) => Buffer.from(c, "latin1"))).pipe(redactor)
  await done
  return { out, text: out.join(""), count: redactor.count }
}

describe("response redaction", () => {
  it("replaces a secret split at every chunk boundary, and counts it", async () => {
    const body = `{"echo":"${SECRET}","again":"${SECRET}${SECRET}"}`
    for (let cut = 0; cut <= body.length; cut++) {
      for (const step of [1, 3, 7]) {
        const chunks = [body.slice(0, cut)]
        for (let at = cut; at < body.length; at += step) chunks.push(body.slice(at, at + step))
        const { text, count } = await run([SECRET], chunks)
        expect(text).toBe(`{"echo":"abox-placeholder","again":"abox-placeholderabox-placeholder"}`)
        expect(count).toBe(3)
      }
    }
  })

  it("holds back only a tail that could begin a secret: an SSE event goes out whole, at once", async () => {
    const event = `data: {"text":"hello"}\n\n`
    const { out } = await run([SECRET], [event, `data: sk-can`, `ary-0123456789abcdef\n\n`])
    // the first event is emitted alone, before the next chunk; "sk-can" waits for what follows it
    expect(out[0]).toBe(event)
    expect(out.join("")).toBe(`${event}data: abox-placeholder\n\n`)
    // a tail that began a secret but did not become one is emitted as it was
    const partial = await run([SECRET], ["x sk-canary-01", "2 y"])
    expect(partial.text).toBe("x sk-canary-012 y")
    expect(partial.count).toBe(0)
    // at the end of the stream the held tail is flushed
    expect((await run([SECRET], ["ends with sk-canary"])).text).toBe("ends with sk-canary")
  })

  it("several secrets (a token and its basic-auth form), overlapping prefixes, binary bytes", async () => {
    const basic = Buffer.from(`x-access-token:${SECRET}`).toString("base64")
    const { text, count } = await run(
      [SECRET, basic],
      ["\x00\xff", basic.slice(0, 5), basic.slice(5), " sk-sk-canary-", "0123456789abcdef\xfe"]
    )
    expect(text).toBe("\x00\xffabox-placeholder sk-abox-placeholder\xfe")
    expect(count).toBe(2)
    // a secret repeating its own prefix (KMP fallback) across a boundary
    const odd = "abab-abac"
    expect((await run([odd], ["xxabab-ab", "ab-abac!"])).text).toBe("xxabab-abox-placeholder!")
  })

  it("header text: every occurrence replaced, count returned; no secret, no change", () => {
    expect(redactText(`Bearer ${SECRET}, ${SECRET}`, secretNeedles([SECRET]))).toEqual({
      text: "Bearer abox-placeholder, abox-placeholder",
      count: 2
    })
    expect(redactText("plain", secretNeedles([SECRET]))).toEqual({ text: "plain", count: 0 })
    expect(redactText("plain", secretNeedles([]))).toEqual({ text: "plain", count: 0 })
    // the placeholder itself and empty strings are never needles
    expect(secretNeedles(["", "abox-placeholder", SECRET, SECRET])).toHaveLength(1)
  })
})
