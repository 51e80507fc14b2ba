/**
 * The model agent's events on a terminal (a prompt turn): the answer streamed to stdout; on
 * stderr one line per tool call with its status and time, retries, compaction notes, usage per
 * turn, and why a turn stopped when it did not simply finish. Tool output stays collapsed (the
 * interactive `/tools` shows the last turn's in full). Everything the guest chose is escaped
 * (src/lib/text.ts) before it reaches the terminal.
 */
import { escapeControl } from "../lib/text.js"
import type { AgentEvent } from "../protocol/Messages.js"

type ModelEvent = Extract<
  AgentEvent,
  { kind: "text" | "tool_call" | "tool_result" | "usage" | "retry" | "agent_end" }
>

export const isModelEvent = (event: AgentEvent): event is ModelEvent =>
  event.kind === "text" ||
  event.kind === "tool_call" ||
  event.kind === "tool_result" ||
  event.kind === "usage" ||
  event.kind === "retry" ||
  event.kind === "agent_end"

const oneLine = (text: string, max: number): string => {
  const flat = escapeControl(text.replace(/\s+/g, " ").trim())
  return flat.length <= max ? flat : `${flat.slice(0, max - 1)}…`
}

/** the part of a tool's input worth a glance: its command, path or pattern */
export const summarizeInput = (input: unknown): string => {
  if (typeof input !== "object" || input === null) return oneLine(JSON.stringify(input) ?? "", 80)
  const record = input as Record<string, unknown>
  for (const key of ["command", "path", "pattern"]) {
    const value = record[key]
    if (typeof value === "string") return oneLine(value, 80)
  }
  return oneLine(JSON.stringify(input), 80)
}

const seconds = (ms: number) => `${(ms / 1000).toFixed(1)}s`

export interface AgentRenderer {
  /** the lines (and stdout text) for one event */
  readonly render: (event: ModelEvent) => { readonly stdout: string; readonly stderr: string }
  /** the tool results of the current turn, for `/tools` */
  readonly toolOutputs: () => ReadonlyArray<{ readonly title: string; readonly output: string }>
}

/**
 * A renderer for one session's prompt turns. `live`: the terminal can rewrite a line (a tool's
 * line appears when it starts and is completed in place when it ends).
 */
export const agentRenderer = (live: boolean): AgentRenderer => {
  const calls = new Map<string, string>()
  let open: string | undefined
  let midText = false
  let outputs: Array<{ title: string; output: string }> = []
  const endText = () => {
    if (!midText) return ""
    midText = false
    return "\n"
  }
  const closeOpen = () => {
    if (open === undefined) return ""
    open = undefined
    return "\n"
  }
  const render = (event: ModelEvent): { stdout: string; stderr: string } => {
    switch (event.kind) {
      case "text": {
        const text = escapeControl(event.delta, { keepNewlines: true })
        if (text === "") return { stdout: "", stderr: "" }
        midText = !text.endsWith("\n")
        return { stdout: text, stderr: closeOpen() }
      }
      case "tool_call": {
        const title = `${oneLine(event.name, 40)}: ${summarizeInput(event.input)}`
        calls.set(event.id, title)
        const before = endText()
        if (!live) return { stdout: before, stderr: "" }
        const line = `${closeOpen()}  ⋯ ${title}`
        open = event.id
        return { stdout: before, stderr: line }
      }
      case "tool_result": {
        const title = calls.get(event.id) ?? oneLine(event.name, 40)
        outputs.push({ title, output: escapeControl(event.output, { keepNewlines: true }) })
        const status = event.isError
          ? `✗ ${title}${event.exitCode !== null && event.exitCode !== 0 ? ` (exit ${event.exitCode})` : ""}`
          : `✓ ${title}`
        const line = `  ${status}  ${seconds(event.durationMs)}${event.truncated ? " (output cut)" : ""}\n`
        if (live && open === event.id) {
          open = undefined
          return { stdout: endText(), stderr: `\r\x1b[2K${line}` }
        }
        return { stdout: endText(), stderr: closeOpen() + line }
      }
      case "retry":
        return {
          stdout: endText(),
          stderr: `${closeOpen()}  ↻ model request retry ${event.attempt} in ${seconds(event.delayMs)} (${oneLine(event.reason, 80)})\n`
        }
      case "usage":
        return {
          stdout: endText(),
          stderr:
            `${closeOpen()}  · ${event.inputTokens} in / ${event.outputTokens} out tokens` +
            (event.costUsd === undefined ? "" : `, $${event.costUsd.toFixed(4)}`) +
            ` (${oneLine(event.model, 40)})\n`
        }
      case "agent_end": {
        const head = endText()
        const close = closeOpen()
        const turnOutputs = outputs
        outputs = []
        lastOutputs = turnOutputs
        calls.clear()
        if (event.reason === "done") return { stdout: head, stderr: close }
        const why = event.message === undefined ? event.reason : oneLine(event.message, 400)
        return { stdout: head, stderr: `${close}abox: the agent stopped (${event.reason}): ${why}\n` }
      }
    }
  }
  let lastOutputs: ReadonlyArray<{ title: string; output: string }> = []
  return { render, toolOutputs: () => (outputs.length > 0 ? outputs : lastOutputs) }
}
