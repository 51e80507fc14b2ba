import * as Effect from "effect/Effect"
import type { TurnEvent } from "../services/GuestRpc.js"
import { agentRenderer, isModelEvent } from "./agentOutput.js"

/** the model agent's events of this process's turns (one terminal: one renderer) */
export const agentOutput = agentRenderer(process.stderr.isTTY === true)

/** One event of a turn on the terminal: the guest's stdout to stdout, stderr to stderr. */
export const printEvent = (event: TurnEvent) =>
  Effect.sync(() => {
    if (event._tag === "End") return
    const e = event.event
    if (isModelEvent(e)) {
      const { stdout, stderr } = agentOutput.render(e)
      if (stdout !== "") process.stdout.write(stdout)
      if (stderr !== "") process.stderr.write(stderr)
      return
    }
    switch (e.kind) {
      case "stdout":
        process.stdout.write(e.data)
        return
      case "stderr":
        process.stderr.write(e.data)
        return
      case "json":
        process.stdout.write(JSON.stringify(e.value) + "\n")
        return
      case "status":
        process.stderr.write(`· ${e.message}\n`)
    }
  })

/** the shell's convention for the end of a turn: its exit code, or 128 + the signal's number */
export const turnExitCode = (end: TurnEvent | undefined): number => {
  if (end === undefined || end._tag !== "End") return 1
  if (end.exitCode !== null) return end.exitCode
  if (end.cancelled) return 130
  return 128 + (end.signal !== null ? (signalNumbers[end.signal] ?? 0) : 0)
}
const signalNumbers: Readonly<Record<string, number>> = { SIGHUP: 1, SIGINT: 2, SIGKILL: 9, SIGTERM: 15 }
