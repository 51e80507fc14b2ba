/**
 * The Mux decodes and encodes a control message with the one member of ControlMessage that its
 * `type` names, instead of searching the whole union. It must check exactly as much as the
 * union: same verdict, same value, same error text, on valid messages and hostile ones alike.
 */
import { readFileSync } from "node:fs"
import { describe, expect, it } from "@effect/vitest"
import * as Either from "effect/Either"
import * as ParseResult from "effect/ParseResult"
import * as Schema from "effect/Schema"
import * as fc from "fast-check"
import { ControlMessage } from "../src/protocol/Messages.js"
import { decodeControlPayload, encodeControlPayload } from "../src/protocol/Mux.js"

const unionDecode = Schema.decodeUnknownEither(Schema.parseJson(ControlMessage))
const unionEncode = Schema.encodeSync(Schema.parseJson(ControlMessage))

const vectors = JSON.parse(
  readFileSync(new URL("./fixtures/protocol-v4/vectors.json", import.meta.url), "utf8")
) as { valid: Array<{ decoded: { kind: string; message?: Record<string, unknown> } }> }
const messages = vectors.valid.flatMap((v) => (v.decoded.kind === "CONTROL" ? [v.decoded.message!] : []))
const types = [...new Set(messages.map((m) => m.type as string))]

/** the union's verdict on a text, in the Mux's terms */
const viaUnion = (text: string) => {
  const decoded = unionDecode(text)
  return Either.isLeft(decoded)
    ? {
        ok: false,
        value: `invalid control message: ${ParseResult.TreeFormatter.formatErrorSync(decoded.left)}`
      }
    : { ok: true, value: decoded.right }
}
const viaMux = (text: string) => {
  const decoded = decodeControlPayload(Buffer.from(text))
  return Either.isLeft(decoded)
    ? { ok: false, value: decoded.left.reason }
    : { ok: true, value: decoded.right }
}

describe("control payload codec", () => {
  it("every message type of the vectors decodes and encodes as the union does", () => {
    expect(types.length).toBeGreaterThanOrEqual(15)
    for (const message of messages) {
      const text = JSON.stringify(message)
      expect(viaMux(text)).toEqual(viaUnion(text))
      const decoded = Either.getOrThrow(decodeControlPayload(Buffer.from(text)))
      expect(Buffer.from(encodeControlPayload(decoded)).toString()).toBe(unionEncode(decoded))
    }
  })

  it("hostile variations of every message get the union's verdict, value and error text", () => {
    const anyValue = fc.oneof(
      fc.jsonValue(),
      fc.constantFrom(null, -1, 0, 2 ** 32, 1.5, "", "x", true, [], {}, 262144, "__proto__")
    )
    const mutation = fc.tuple(
      fc.constantFrom(...messages),
      fc.array(
        fc.oneof(
          fc.record({ op: fc.constant("drop" as const), key: fc.nat() }),
          fc.record({ op: fc.constant("set" as const), key: fc.nat(), value: anyValue }),
          fc.record({ op: fc.constant("add" as const), name: fc.string({ maxLength: 8 }), value: anyValue }),
          fc.record({ op: fc.constant("type" as const), type: fc.constantFrom(...types, "nope", "") })
        ),
        { maxLength: 4 }
      )
    )
    fc.assert(
      fc.property(mutation, ([message, ops]) => {
        const m: Record<string, unknown> = structuredClone(message)
        for (const op of ops) {
          const keys = Object.keys(m)
          if (op.op === "drop" && keys.length > 0) delete m[keys[op.key % keys.length]!]
          if (op.op === "set" && keys.length > 0) m[keys[op.key % keys.length]!] = op.value
          if (op.op === "add") m[op.name] = op.value
          if (op.op === "type") m.type = op.type
        }
        const text = JSON.stringify(m)
        expect(viaMux(text)).toEqual(viaUnion(text))
      }),
      { numRuns: 1000 }
    )
  })

  it("payloads that are not a message object get the union's verdict", () => {
    for (const text of [
      "",
      "null",
      "[]",
      "1",
      '"hello"',
      "{",
      '{"type":1}',
      '{"type":null}',
      '{"type":"toString"}',
      '{"type":"__proto__"}',
      '{"type":"constructor"}'
    ]) {
      expect(viaMux(text), text).toEqual(viaUnion(text))
    }
  })

  it("an invalid outgoing message is refused as before", () => {
    const extra = { type: "ready", extra: 1 } as unknown as ControlMessage
    expect(Buffer.from(encodeControlPayload(extra)).toString()).toBe(unionEncode(extra))
    expect(() => encodeControlPayload({ type: "turn_end", turn: "x" } as unknown as ControlMessage)).toThrow()
    expect(() => encodeControlPayload({ type: "nope" } as unknown as ControlMessage)).toThrow()
  })
})
