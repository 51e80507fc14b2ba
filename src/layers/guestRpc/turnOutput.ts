/**
 * The host's end of a turn's output channel (FEATURE_OUTPUT): the guest's records as TurnEvents,
 * and a turn's events from both of its paths (records on the channel, the rest as control
 * messages) with `End` last.
 * Pull-based: a record is read off the channel only when the turn's consumer asks for the next
 * event, and the channel's credit goes back only as it is read, so a consumer that stops
 * reading (a full terminal) stops the guest's command within one window.
 */
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import type { AgentEvent } from "../../protocol/Messages.js"
import { OutputRecordDecoder, OutputRecordError, type OutputRecord } from "../../protocol/TurnOutput.js"
import { ProtocolError, type TurnEvent } from "../../services/GuestRpc.js"

const strictUtf8 = new TextDecoder("utf-8", { fatal: true })
const lossyUtf8 = new TextDecoder("utf-8")

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

/** the records on an output channel's bytes, as stdout/stderr events; a malformed record fails */
export const outputEvents = <E>(bytes: Stream.Stream<Uint8Array, E>): Stream.Stream<TurnEvent, E | ProtocolError> =>
  Stream.suspend(() => {
    const decoder = new OutputRecordDecoder()
    return bytes.pipe(
      Stream.mapConcatEffect((chunk) =>
        Effect.try({ try: () => decoder.push(chunk).map(recordEvent), catch: malformedOutput })
      ),
      Stream.concat(Stream.drain(Stream.fromEffect(Effect.try({ try: () => decoder.end(), catch: malformedOutput }))))
    )
  })

/**
 * A turn's events when its output comes on a channel: the records and the control events as
 * they come, the control path's `End` only after the channel's EOF (the guest sends that EOF
 * before turn_end, so no output is lost to a reordering on the host).
 */
export const withOutputChannel = <E1, E2>(
  records: Stream.Stream<TurnEvent, E1>,
  control: Stream.Stream<TurnEvent, E2>
): Stream.Stream<TurnEvent, E1 | E2> =>
  Stream.suspend(() => {
    let end: TurnEvent | undefined
    const beforeEnd = control.pipe(
      Stream.filter((event) => {
        if (event._tag !== "End") return true
        end = event
        return false
      })
    )
    return Stream.merge(records, beforeEnd).pipe(
      Stream.concat(Stream.suspend(() => (end === undefined ? Stream.empty : Stream.make(end))))
    )
  })
