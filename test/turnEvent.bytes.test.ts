/**
 * A turn's output bytes through every wire they cross as an event: the guest's `agent_event`
 * (guest/turns.ts `outputEvent`), the host's output-channel record (`recordEvent`), then a
 * supervisor's control reply (the Turn RPC's element, JSON) rebuilt on the client by `agentTurnEvent`, the one
 * rebuild the CLI and the SDK share. Each comes back exactly, a leading BOM included.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Either from "effect/Either"
import * as crypto from "node:crypto"
import { outputEvent } from "../src/guest/turns.js"
import { recordEvent } from "../src/layers/guestRpc/turnOutput.js"
import * as Schema from "effect/Schema"
import { TurnOutput } from "../src/services/ControlRpc.js"
import type { AgentEvent } from "../src/protocol/Messages.js"
import { agentTurnEvent } from "../src/services/GuestRpc.js"

const cases: ReadonlyArray<readonly [string, Uint8Array]> = [
  ["text", Buffer.from("abc\n")],
  ["a leading BOM", Buffer.from([0xef, 0xbb, 0xbf, 0x61, 0x0a])],
  ["only a BOM", Buffer.from([0xef, 0xbb, 0xbf])],
  ["invalid UTF-8", Buffer.from([0xff, 0xfe, 0x00, 0x80])],
  ["NUL and ESC", Buffer.from([0x00, 0x1b, 0x5b, 0x32, 0x4a])],
  ["random", crypto.randomBytes(64 * 1024)]
]

/** the event as a supervisor relays it and a client reads it back */
const relayed = (event: AgentEvent): Uint8Array => {
  const line = Schema.encodeSync(Schema.parseJson(TurnOutput))({ _tag: "Event", turn: 1, event })
  const reply = Either.getOrThrow(Schema.decodeUnknownEither(Schema.parseJson(TurnOutput))(line))
  if (reply._tag !== "Event") throw new Error(`expected an event, got ${reply._tag}`)
  const rebuilt = agentTurnEvent(reply.event)
  if (rebuilt._tag !== "Event" || rebuilt.bytes === undefined) throw new Error("no bytes rebuilt")
  return rebuilt.bytes
}

describe("a turn's bytes through its events", () => {
  for (const [name, bytes] of cases) {
    it(`${name}: the guest's agent_event, relayed by a supervisor`, () => {
      expect(Buffer.from(relayed(outputEvent("stdout", bytes))).toString("hex")).toBe(
        Buffer.from(bytes).toString("hex")
      )
    })
    it(`${name}: the host's output record, as an event and relayed by a supervisor`, () => {
      const event = recordEvent({ kind: "stderr", bytes })
      if (event._tag !== "Event") throw new Error("not an event")
      const rebuilt = agentTurnEvent(event.event)
      expect(Buffer.from(rebuilt._tag === "Event" ? (rebuilt.bytes ?? []) : []).toString("hex")).toBe(
        Buffer.from(bytes).toString("hex")
      )
      expect(Buffer.from(relayed(event.event)).toString("hex")).toBe(Buffer.from(bytes).toString("hex"))
    })
  }
})
