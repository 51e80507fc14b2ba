import * as Effect from "effect/Effect"
import { escapeControl } from "../lib/text.js"
import { agentTurnEvent, type TurnEvent } from "../services/GuestRpc.js"
import { agentRenderer, isModelEvent } from "./agentOutput.js"

/** the model agent's events of this process's turns (one terminal: one renderer) */
export const agentOutput = agentRenderer(process.stderr.isTTY === true)

/** the exact bytes of a stdout/stderr event (`bytes`, else rebuilt from the event as relayed) */
const outputBytes = (event: TurnEvent): Uint8Array | undefined => {
  if (event._tag !== "Event" || (event.event.kind !== "stdout" && event.event.kind !== "stderr"))
    return undefined
  const rebuilt = agentTurnEvent(event.event)
  return event.bytes ?? (rebuilt._tag === "Event" ? rebuilt.bytes : undefined)
}

/**
 * Writes to the terminal (or file, or pipe) and waits while it is full: a reader slower than the
 * turn (a pager, `| less`) pauses the turn's output instead of filling this process's memory.
 */
export const writeOutput = (stream: NodeJS.WritableStream, data: string | Uint8Array): Effect.Effect<void> =>
  Effect.suspend(() =>
    stream.write(data)
      ? Effect.void
      : Effect.async<void>((resume) => {
          const done = () => {
            stream.off("drain", done)
            stream.off("close", done)
            stream.off("error", done)
            resume(Effect.void)
          }
          stream.on("drain", done)
          // a reader that went away (EPIPE) is not waited for
          stream.on("close", done)
          stream.on("error", done)
          return Effect.sync(() => {
            stream.off("drain", done)
            stream.off("close", done)
            stream.off("error", done)
          })
        })
  )

/** One event of a turn on the terminal: the guest's stdout to stdout, stderr to stderr. */
export const printEvent = (event: TurnEvent): Effect.Effect<void> =>
  Effect.suspend(() => {
    if (event._tag === "End") return Effect.void
    const e = event.event
    if (isModelEvent(e)) {
      const { stdout, stderr } = agentOutput.render(e)
      return Effect.zipRight(
        stdout !== "" ? writeOutput(process.stdout, stdout) : Effect.void,
        stderr !== "" ? writeOutput(process.stderr, stderr) : Effect.void
      )
    }
    switch (e.kind) {
      case "stdout":
        return writeOutput(process.stdout, outputBytes(event)!)
      case "stderr":
        return writeOutput(process.stderr, outputBytes(event)!)
      case "json":
        return writeOutput(process.stdout, JSON.stringify(e.value) + "\n")
      case "status":
        return writeOutput(process.stderr, `· ${escapeControl(e.message)}\n`)
    }
    return Effect.void
  })

// ignoreBOM: a leading U+FEFF stays in the text, so the text re-encodes to the same bytes
const strictUtf8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true })

/**
 * A turn event as `--json` prints it: stdout/stderr carry `data` (text) when the chunk is valid
 * UTF-8, else `base64` (the exact bytes) instead; other events as they are.
 */
export const jsonEvent = (event: TurnEvent): unknown => {
  const bytes = outputBytes(event)
  if (event._tag !== "Event" || bytes === undefined) return event
  const kind = event.event.kind
  try {
    return { _tag: "Event", event: { kind, data: strictUtf8.decode(bytes) } }
  } catch {
    return { _tag: "Event", event: { kind, base64: Buffer.from(bytes).toString("base64") } }
  }
}

/** the shell's convention for the end of a turn: its exit code, or 128 + the signal's number */
export const turnExitCode = (end: TurnEvent | undefined): number => {
  if (end === undefined || end._tag !== "End") return 1
  if (end.exitCode !== null) return end.exitCode
  if (end.cancelled) return 130
  return 128 + (end.signal !== null ? (signalNumbers[end.signal] ?? 0) : 0)
}
const signalNumbers: Readonly<Record<string, number>> = { SIGHUP: 1, SIGINT: 2, SIGKILL: 9, SIGTERM: 15 }
