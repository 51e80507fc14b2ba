import { readFileSync } from "node:fs"
import { describe, expect, it } from "@effect/vitest"
import * as Either from "effect/Either"
import * as Schema from "effect/Schema"
import { encodeFrame, FrameDecoder, FrameKind } from "../src/protocol/Frame.js"
import { decodeControlPayload, encodeControlPayload } from "../src/protocol/Mux.js"

// The model agent's golden frames (generated once by test/fixtures/protocol-v4/generate-agent.ts):
// an encoder change that alters a byte fails here, because guests already send these bytes.
const Vectors = Schema.Struct({
  protocol: Schema.Literal(4),
  valid: Schema.Array(
    Schema.Struct({
      name: Schema.String,
      meaning: Schema.String,
      hex: Schema.String,
      message: Schema.Unknown
    })
  )
})
const vectors = Schema.decodeUnknownSync(Schema.parseJson(Vectors))(
  readFileSync(new URL("./fixtures/protocol-v4/agent-vectors.json", import.meta.url), "utf8")
)

describe("protocol v4 agent vectors", () => {
  it("cover every agent event kind and the prompt turn", () => {
    expect(vectors.valid.map((v) => v.name)).toEqual(
      expect.arrayContaining([
        "user_turn-prompt",
        "agent_event-text",
        "agent_event-tool_call",
        "agent_event-tool_result",
        "agent_event-usage",
        "agent_event-retry",
        "agent_event-agent_end"
      ])
    )
  })

  it.each(vectors.valid.map((v) => [v.name, v] as const))(
    "%s decodes to its message and re-encodes byte for byte",
    (_, v) => {
      const bytes = Buffer.from(v.hex, "hex")
      const decoder = new FrameDecoder()
      const frames = decoder.push(bytes)
      expect(frames).toHaveLength(1)
      expect(frames[0]!.kind).toBe(FrameKind.Control)
      const message = decodeControlPayload(frames[0]!.payload)
      expect(Either.isRight(message)).toBe(true)
      expect(Either.getOrThrow(message)).toEqual(v.message)
      const again = encodeFrame({
        channel: 0,
        kind: FrameKind.Control,
        payload: encodeControlPayload(Either.getOrThrow(message))
      })
      expect(Buffer.from(again).toString("hex")).toBe(v.hex)
    }
  )

  it("an agent event with an unknown reason is refused (a protocol error, not a crash)", () => {
    const payload = Buffer.from(
      JSON.stringify({
        type: "agent_event",
        turn: 1,
        event: { kind: "agent_end", reason: "exploded", steps: 0 }
      })
    )
    expect(Either.isLeft(decodeControlPayload(payload))).toBe(true)
  })
})
