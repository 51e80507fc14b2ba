/**
 * The host's end of a turn's output channel (FEATURE_OUTPUT): the guest's records as TurnEvents.
 * turns.ts reads the channel in the turn's own pull, and merges it with the control path (End
 * last): a record is read off the channel only when the turn's consumer asks for the next event,
 * and the channel's credit goes back only as it is read, so a consumer that stops reading (a
 * full terminal) stops the guest's command within one window.
 */
import type { AgentEvent } from "../../protocol/Messages.js"
import { OutputRecordError, type OutputRecord } from "../../protocol/TurnOutput.js"
import { ProtocolError, type TurnEvent } from "../../services/GuestRpc.js"

// ignoreBOM: a leading U+FEFF stays in the text, so the text re-encodes to the same bytes
const strictUtf8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true })
const lossyUtf8 = new TextDecoder("utf-8", { ignoreBOM: true })

/** a record as the event an `agent_event` would have made of it: text, or base64 when not UTF-8 */
export const recordEvent = (record: OutputRecord): TurnEvent => {
  let event: AgentEvent
  try {
    event = { kind: record.kind, data: strictUtf8.decode(record.bytes) }
  } catch {
    event = {
      kind: record.kind,
      data: lossyUtf8.decode(record.bytes),
      base64: Buffer.from(record.bytes).toString("base64")
    }
  }
  return { _tag: "Event", event, bytes: record.bytes }
}

export const malformedOutput = (cause: unknown) =>
  new ProtocolError({
    reason: "bad turn output",
    message: cause instanceof OutputRecordError ? cause.message : `turn output channel: ${String(cause)}`
  })
