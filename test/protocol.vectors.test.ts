import { readFileSync } from "node:fs"
import { describe, expect, it } from "@effect/vitest"
import * as Either from "effect/Either"
import * as Schema from "effect/Schema"
import {
  decodeCredit,
  encodeCredit,
  encodeFrame,
  FrameDecoder,
  FrameError,
  FrameKind
} from "../src/protocol/Frame.js"
import type { Frame } from "../src/protocol/Frame.js"
import { decodeControlPayload, encodeControlPayload } from "../src/protocol/Mux.js"

// The golden vectors are fixed files (generated once by test/fixtures/protocol-v4/generate.ts,
// never by this test): if an encoder change alters a byte, this test fails, because old guests
// still send and expect exactly these bytes.
const Vectors = Schema.Struct({
  protocol: Schema.Literal(4),
  valid: Schema.Array(
    Schema.Struct({
      name: Schema.String,
      meaning: Schema.String,
      hex: Schema.String,
      decoded: Schema.Struct({
        channel: Schema.Number,
        kind: Schema.Literal("CONTROL", "DATA", "CREDIT", "EOF"),
        message: Schema.optional(Schema.Unknown),
        payloadHex: Schema.optional(Schema.String),
        credit: Schema.optional(Schema.Number)
      })
    })
  ),
  invalidFrames: Schema.Array(
    Schema.Struct({ name: Schema.String, hex: Schema.String, reason: Schema.String })
  ),
  invalidControl: Schema.Array(Schema.Struct({ name: Schema.String, hex: Schema.String }))
})

const vectors = Schema.decodeUnknownSync(Schema.parseJson(Vectors))(
  readFileSync(new URL("./fixtures/protocol-v4/vectors.json", import.meta.url), "utf8")
)
const kinds = {
  CONTROL: FrameKind.Control,
  DATA: FrameKind.Data,
  CREDIT: FrameKind.Credit,
  EOF: FrameKind.Eof
} as const
const hex = (bytes: Uint8Array) => Buffer.from(bytes).toString("hex")

const decodeOne = (bytes: Uint8Array, byteByByte: boolean): Frame => {
  const decoder = new FrameDecoder()
  const frames: Array<Frame> = []
  if (byteByByte) for (const b of bytes) frames.push(...decoder.push(new Uint8Array([b])))
  else frames.push(...decoder.push(bytes))
  decoder.finish()
  expect(frames).toHaveLength(1)
  return frames[0]!
}

describe("protocol v4 golden vectors", () => {
  it("cover every message type and frame kind", () => {
    const names = new Set(vectors.valid.map((v) => v.name))
    for (const required of [
      "hello",
      "ready",
      "user_turn",
      "agent_event-stdout",
      "agent_event-stdout-binary",
      "agent_event-json",
      "turn_end",
      "cancel",
      "transfer_begin",
      "transfer_end",
      "data",
      "credit",
      "eof",
      "shutdown",
      "error-turn",
      "tunnel_open",
      "tunnel_accept",
      "tunnel_deny",
      "tunnel_close"
    ]) {
      expect(names.has(required), required).toBe(true)
    }
  })

  for (const vector of vectors.valid) {
    it(`${vector.name}: decodes to its meaning and re-encodes byte for byte`, () => {
      const bytes = Buffer.from(vector.hex, "hex")
      for (const byteByByte of [false, true]) {
        const frame = decodeOne(bytes, byteByByte)
        expect(frame.channel).toBe(vector.decoded.channel)
        expect(frame.kind).toBe(kinds[vector.decoded.kind])
        let payload: Uint8Array
        switch (vector.decoded.kind) {
          case "CONTROL": {
            const message = decodeControlPayload(frame.payload)
            if (Either.isLeft(message)) throw message.left
            expect(message.right).toEqual(vector.decoded.message)
            payload = encodeControlPayload(message.right)
            break
          }
          case "DATA":
            expect(hex(frame.payload)).toBe(vector.decoded.payloadHex)
            payload = Buffer.from(vector.decoded.payloadHex!, "hex")
            break
          case "CREDIT":
            expect(decodeCredit(frame.payload)).toBe(vector.decoded.credit)
            payload = encodeCredit(vector.decoded.credit!)
            break
          case "EOF":
            expect(frame.payload.length).toBe(0)
            payload = new Uint8Array(0)
        }
        expect(hex(encodeFrame({ channel: frame.channel, kind: frame.kind, payload }))).toBe(vector.hex)
      }
    })
  }

  it("all valid vectors back to back, in one stream, decode in order", () => {
    const stream = Buffer.concat(vectors.valid.map((v) => Buffer.from(v.hex, "hex")))
    const decoder = new FrameDecoder()
    const frames = [...decoder.push(stream.subarray(0, 100)), ...decoder.push(stream.subarray(100))]
    expect(frames.map((f) => f.channel)).toEqual(vectors.valid.map((v) => v.decoded.channel))
  })

  for (const vector of vectors.invalidFrames) {
    it(`invalid frame ${vector.name}: FrameError "${vector.reason}"`, () => {
      const decoder = new FrameDecoder()
      let error: unknown
      try {
        decoder.push(Buffer.from(vector.hex, "hex"))
        decoder.finish()
      } catch (e) {
        error = e
      }
      expect(error).toBeInstanceOf(FrameError)
      expect((error as FrameError).reason).toContain(vector.reason)
    })
  }

  for (const vector of vectors.invalidControl) {
    it(`invalid control payload ${vector.name}: a well-formed frame whose message is refused`, () => {
      const frame = decodeOne(Buffer.from(vector.hex, "hex"), false)
      expect(frame.kind).toBe(FrameKind.Control)
      expect(Either.isLeft(decodeControlPayload(frame.payload))).toBe(true)
    })
  }
})
