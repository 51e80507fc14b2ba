import * as Cause from "effect/Cause"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"
import * as fs from "node:fs/promises"
import { escapeControl } from "../lib/text.js"
import * as Repo from "../programs/repo.js"
import * as readline from "node:readline"
import { writeJsonAtomic } from "../lib/atomicFile.js"
import type { Session } from "../programs/session.js"
import type { TurnEvent } from "../services/GuestRpc.js"
import type { AgentEvent } from "../protocol/Messages.js"
import { CliExit } from "./render.js"
import { agentOutput, printEvent, turnExitCode } from "./turnOutput.js"
import { sessionFile } from "../domain/sessionLayout.js"

/** `transcript.json`: the interactive mode's log of a session (the SDK never writes it). */
export const TRANSCRIPT_FORMAT = 1
/** a prompt turn's structured record: the answer, each tool call with its result, usage, the end */
const AgentTurnRecord = Schema.Struct({
  answer: Schema.String,
  tools: Schema.Array(
    Schema.Struct({
      id: Schema.String,
      name: Schema.String,
      input: Schema.Unknown,
      exitCode: Schema.optional(Schema.NullOr(Schema.Number)),
      output: Schema.optional(Schema.String),
      truncated: Schema.optional(Schema.Boolean),
      isError: Schema.optional(Schema.Boolean),
      durationMs: Schema.optional(Schema.Number)
    })
  ),
  usage: Schema.optional(
    Schema.Struct({
      model: Schema.String,
      inputTokens: Schema.Number,
      outputTokens: Schema.Number,
      costUsd: Schema.optional(Schema.Number)
    })
  ),
  retries: Schema.optional(Schema.Number),
  end: Schema.optional(Schema.Struct({ reason: Schema.String, message: Schema.optional(Schema.String) }))
})
type AgentTurnRecord = typeof AgentTurnRecord.Type
const TranscriptEntry = Schema.Struct({
  at: Schema.String,
  text: Schema.String,
  /** absent: a shell turn (transcripts written before prompt turns existed) */
  mode: Schema.optional(Schema.Literal("shell", "prompt")),
  /** what the turn printed, capped so the file stays small */
  output: Schema.String,
  exitCode: Schema.Number,
  cancelled: Schema.Boolean,
  /** prompt turns: the structured turn */
  agent: Schema.optional(AgentTurnRecord)
})
export const Transcript = Schema.Struct({
  format: Schema.Literal(TRANSCRIPT_FORMAT),
  sessionId: Schema.String,
  entries: Schema.Array(TranscriptEntry)
})
type Transcript = typeof Transcript.Type
const OUTPUT_CAP = 64 * 1024

const decodeTranscript = Schema.decodeUnknown(Schema.parseJson(Transcript))

/** an unreadable transcript is set aside (renamed), never overwritten or deleted */
const loadTranscript = (file: string, sessionId: string): Effect.Effect<Transcript> =>
  Effect.tryPromise(() => fs.readFile(file, "utf8")).pipe(
    Effect.flatMap((text) =>
      decodeTranscript(text).pipe(
        Effect.tapError(() =>
          Effect.promise(() => fs.rename(file, `${file}.corrupt-${Date.now()}`).catch(() => undefined))
        )
      )
    ),
    Effect.orElseSucceed(() => ({ format: TRANSCRIPT_FORMAT, sessionId, entries: [] }) as Transcript)
  )

const HELP =
  "type a prompt for the agent and press Enter · !cmd runs a shell command · /tools shows the last turn's tool output · " +
  "Ctrl-C cancels a running turn · Ctrl-D or /exit closes the session · /diff [--stat] shows the changes since Open · /help"

/** what a turn is, for /help */
const TURN_HELP = [
  HELP,
  "A line is a prompt for the model agent; it answers, and runs its tools (shell, read/write/edit",
  "files, search) in /work/repo as an unprivileged user. `!cmd` is a shell turn: one command line",
  "(or, with --agent, one message to that command), run in /work/repo as that user. It gets no",
  "stdin and no terminal (no editors, no prompts); its output streams here. Each turn is a fresh",
  "process: `cd` and `export` do not carry over to the next (chain with `&&`, or write a script).",
  "Files it changes stay in the session's disk (/diff shows them)."
].join("\n")

/** Ctrl-C at an empty prompt: a hint, not a close (a shell habit must not end the session) */
const CTRL_C_HINT = "(Ctrl-D or /exit closes the session; Ctrl-C cancels a running turn)"

/**
 * a line as typed → the turn: `!cmd` a shell command, anything else a prompt (or, for a session
 * with an agent command, `--agent`, a turn for that command)
 */
export const parseLine = (
  line: string,
  lines: "prompt" | "shell" = "prompt"
): { readonly text: string; readonly mode: "shell" | "prompt" } =>
  line.startsWith("!") ? { text: line.slice(1).trim(), mode: "shell" } : { text: line, mode: lines }

/** folds a prompt turn's events into its transcript record (tool outputs capped) */
const recordAgentEvent = (record: AgentTurnRecord, event: AgentEvent): AgentTurnRecord => {
  switch (event.kind) {
    case "text":
      return record.answer.length < OUTPUT_CAP
        ? { ...record, answer: record.answer + event.delta.slice(0, OUTPUT_CAP - record.answer.length) }
        : record
    case "tool_call":
      return { ...record, tools: [...record.tools, { id: event.id, name: event.name, input: event.input }] }
    case "tool_result":
      return {
        ...record,
        tools: record.tools.map((tool) =>
          tool.id === event.id
            ? {
                ...tool,
                exitCode: event.exitCode,
                output: event.output.slice(0, OUTPUT_CAP),
                truncated: event.truncated || event.output.length > OUTPUT_CAP,
                isError: event.isError,
                durationMs: event.durationMs
              }
            : tool
        )
      }
    case "usage": {
      const { kind: _kind, ...usage } = event
      return { ...record, usage }
    }
    case "retry":
      return { ...record, retries: (record.retries ?? 0) + 1 }
    case "agent_end":
      return {
        ...record,
        end: { reason: event.reason, ...(event.message === undefined ? {} : { message: event.message }) }
      }
    default:
      return record
  }
}

/**
 * The interactive mode: a prompt for turns, events streamed as they come; Ctrl-C cancels the
 * running turn (the turn's stream is interrupted, which sends `cancel`), Ctrl-D or `/exit`
 * returns, and the caller's scope closes the session.
 */
export const interactive = (session: Session, options: { readonly lines?: "prompt" | "shell" } = {}) =>
  Effect.gen(function* () {
    const transcriptFile = sessionFile(session.dir, "transcript")
    let transcript = yield* loadTranscript(transcriptFile, session.id)
    const rl = yield* Effect.acquireRelease(
      Effect.sync(() =>
        readline.createInterface({
          input: process.stdin,
          output: process.stderr,
          terminal: process.stdin.isTTY === true
        })
      ),
      (rl) => Effect.sync(() => rl.close())
    )
    const contextNote = session.hello.contextTurns
      ? `, ${session.hello.contextTurns} earlier turns remembered`
      : ""
    process.stderr.write(`abox: session ${escapeControl(session.id)} ready${contextNote}\n${HELP}\n`)

    // Ctrl-C at the prompt: the hint; while a turn runs, the turn's own listener cancels it
    let turnRunning = false
    yield* Effect.acquireRelease(
      Effect.sync(() => {
        const onIdleCtrlC = () => {
          if (turnRunning) return
          process.stderr.write(`\n${CTRL_C_HINT}\n`)
          rl.prompt()
        }
        rl.on("SIGINT", onIdleCtrlC)
        return onIdleCtrlC
      }),
      (listener) => Effect.sync(() => rl.off("SIGINT", listener))
    )
    // piped turns (no terminal): the exit status is the last failed turn's
    let lastFailure = 0

    const lines = rl[Symbol.asyncIterator]()
    const nextLine = Effect.promise(() => {
      rl.prompt()
      return lines.next()
    })
    rl.setPrompt("abox> ")

    for (;;) {
      const next = yield* nextLine
      if (next.done === true) break
      const text = String(next.value).trim()
      if (text === "") continue
      if (text === "/exit" || text === "/quit") break
      if (text === "/help") {
        process.stderr.write(TURN_HELP + "\n")
        continue
      }
      if (text === "/diff" || text === "/diff --stat") {
        // the holder of a running session runs what `abox diff` cannot from another process
        yield* Repo.diff(session.connection, { stat: text.endsWith("--stat") }).pipe(
          Effect.matchEffect({
            onSuccess: (patch) =>
              Effect.sync(() =>
                process.stdout.write(
                  patch === "" ? "(no changes)\n" : escapeControl(patch, { keepNewlines: true })
                )
              ),
            onFailure: (error) =>
              Effect.sync(() => process.stderr.write(`abox: ${escapeControl(error.message)}\n`))
          })
        )
        continue
      }
      if (text === "/tools") {
        const outputs = agentOutput.toolOutputs()
        if (outputs.length === 0) process.stderr.write("· no tool output in the last turn\n")
        for (const tool of outputs) process.stderr.write(`── ${tool.title}\n${tool.output}\n`)
        continue
      }
      const { text: turnText, mode } = parseLine(text, options.lines)
      if (turnText === "") continue
      const started = new Date().toISOString()
      let output = ""
      let agent: AgentTurnRecord | undefined = mode === "prompt" ? { answer: "", tools: [] } : undefined
      const turn = session.turn(turnText, mode).pipe(
        Stream.tap((event) => {
          if (event._tag === "Event" && (event.event.kind === "stdout" || event.event.kind === "stderr")) {
            if (output.length < OUTPUT_CAP) output += event.event.data.slice(0, OUTPUT_CAP - output.length)
          }
          if (event._tag === "Event" && agent !== undefined) agent = recordAgentEvent(agent, event.event)
          return printEvent(event)
        }),
        Stream.runLast,
        Effect.map(Option.getOrUndefined)
      )
      turnRunning = true
      const fiber = yield* Effect.fork(turn)
      // Ctrl-C while a turn runs cancels it (interrupting the stream sends `cancel` to the guest)
      const ctrlC = Effect.async<void>((resume) => {
        const onCtrlC = () => resume(Effect.sync(() => process.stderr.write("\n· cancelling the turn\n")))
        rl.once("SIGINT", onCtrlC)
        return Effect.sync(() => rl.off("SIGINT", onCtrlC))
      })
      const exit = yield* Effect.raceFirst(
        Fiber.await(fiber),
        Effect.zipRight(ctrlC, Fiber.interrupt(fiber))
      ).pipe(Effect.ensuring(Effect.sync(() => (turnRunning = false))))
      if (Exit.isFailure(exit) && !Cause.isInterruptedOnly(exit.cause))
        return yield* Exit.failCause(exit.cause)
      const end: TurnEvent | undefined = Exit.isSuccess(exit) ? exit.value : undefined
      const cancelled = Exit.isFailure(exit) || (end?._tag === "End" && end.cancelled)
      const code = cancelled ? 130 : turnExitCode(end)
      if (code !== 0) lastFailure = code
      if (code !== 0) process.stderr.write(`· exit ${code}${cancelled ? " (cancelled)" : ""}\n`)
      transcript = {
        ...transcript,
        entries: [
          ...transcript.entries,
          {
            at: started,
            text: turnText,
            mode,
            output: agent === undefined ? output : agent.answer,
            exitCode: code,
            cancelled,
            ...(agent === undefined ? {} : { agent })
          }
        ]
      }
      yield* writeJsonAtomic(transcriptFile, Transcript, transcript).pipe(
        Effect.catchAll((error) =>
          Effect.sync(() =>
            process.stderr.write(`abox: transcript not saved: ${escapeControl(error.message)}\n`)
          )
        )
      )
    }
    if (process.stdin.isTTY !== true && lastFailure !== 0) {
      return yield* new CliExit({ code: lastFailure, tag: "TurnExit" })
    }
  })
