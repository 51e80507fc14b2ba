/**
 * The agent loop of a prompt turn: user text → model request (streamed) → tool calls → results →
 * model … → final answer, at most `maxSteps` requests and, with `maxCostUsd`, until the turn's
 * cost (usage × the catalog's prices) reaches it. Every step's text deltas, tool calls and
 * results become events as they happen; the conversation (an @effect/ai Prompt) grows by each
 * completed step and is handed to `onStep` (context.json is saved), so a cancelled, failed or
 * killed turn keeps what was finished.
 *
 * Near the context window the conversation is compacted: the model is asked for a summary of
 * the earlier exchanges, which replaces them; when that request fails, older tool outputs are
 * trimmed and the oldest exchanges dropped instead (`compact`).
 *
 * Model errors are events, never hangs: 401/403 name the host's key variable, 429/529/5xx are
 * retried with backoff (each retry an event), a broker refusal is reported with its reason, a
 * stream cut mid-answer ends the turn with an error.
 */
import type * as AiError from "@effect/ai/AiError"
import * as LanguageModel from "@effect/ai/LanguageModel"
import * as Prompt from "@effect/ai/Prompt"
import type * as Response from "@effect/ai/Response"
import type * as Toolkit from "@effect/ai/Toolkit"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Ref from "effect/Ref"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"
import type { ModelSpec } from "../../protocol/GuestConfig.js"
import type { AgentEvent } from "../../protocol/Messages.js"
import type { AgentToolkit, ToolOutput } from "./tools.js"

export const DEFAULT_MAX_STEPS = 50
/** retries of one model request (429, 529, 5xx, a transport failure before any output) */
export const MAX_RETRIES = 4
const BASE_DELAY_MS = 1000
const MAX_DELAY_MS = 60_000
/** compaction starts when the estimate passes this share of the context window */
const COMPACT_AT = 0.75
/** tool results of the newest messages are never trimmed */
const KEEP_RECENT_MESSAGES = 6
const TRIMMED = "[output trimmed to save context]"

export const SYSTEM_PROMPT = `You are a coding agent working inside an isolated VM on a copy of the user's repository at /work/repo.
Use the tools to inspect and change the repository: read_file, list_files and search to look; edit_file (exact replacement) and write_file to change files; shell to run commands (tests, builds, git).
Work step by step, check your changes (run the tests when there are any), and end with a short answer saying what you did.`

export type AgentTools = Toolkit.Tools<typeof AgentToolkit>
export type AgentToolkitWithHandlers = Toolkit.WithHandler<AgentTools>

export type Emit = (event: AgentEvent) => Effect.Effect<void>

export interface LoopOptions {
  readonly spec: ModelSpec
  readonly maxSteps: number
  /** US dollars: the turn stops once its cost reaches this (needs the spec's prices) */
  readonly maxCostUsd?: number | undefined
  /** the system prompt (default SYSTEM_PROMPT) */
  readonly systemPrompt?: string | undefined
  /** after each completed step, the conversation holding it (context.json is saved) */
  readonly onStep?: (() => Effect.Effect<void>) | undefined
  readonly emit: Emit
  /** the broker's last refusal (host, port, reason), for a transport error's message */
  readonly lastRefusal: () => string | undefined
}

export interface TurnSummary {
  readonly reason: "done" | "max_steps" | "max_cost" | "error"
  readonly steps: number
  readonly message?: string
}

export const encodePrompt = Schema.encodeSync(Prompt.Prompt)
const decodePrompt = Schema.decodeUnknownEither(Prompt.Prompt)

/** the conversation from context.json's `messages` (an undecodable history starts empty) */
export const promptFromMessages = (messages: ReadonlyArray<unknown>): Either.Either<Prompt.Prompt, string> =>
  Either.mapLeft(decodePrompt({ content: messages }), (error) => error.message)

export const messagesOf = (prompt: Prompt.Prompt): ReadonlyArray<unknown> => encodePrompt(prompt).content

/** a rough token estimate (4 characters a token) of a conversation */
export const estimateTokens = (prompt: Prompt.Prompt): number =>
  Math.ceil(JSON.stringify(encodePrompt(prompt)).length / 4)

export const SUMMARY_MARK = "[Earlier conversation, dropped to fit the context window."
const SUMMARY_MAX_CHARS = 2000

const clip = (text: string, max: number): string => {
  const line = text.replace(/\s+/g, " ").trim()
  return line.length > max ? `${line.slice(0, max - 1)}…` : line
}

type UserContent = Extract<Prompt.MessageEncoded, { role: "user" }>["content"]

const stripSummary = (content: UserContent): UserContent =>
  typeof content === "string"
    ? content
    : content.filter((part) => !(part.type === "text" && part.text.startsWith(SUMMARY_MARK)))

/**
 * A deterministic summary of dropped messages: an earlier summary's lines, each user request
 * (clipped), each tool call (name and its path or command), the files touched; the newest lines
 * kept when it grows past its bound.
 */
export const summaryOf = (dropped: ReadonlyArray<Prompt.MessageEncoded>): string => {
  const lines: Array<string> = []
  const files = new Set<string>()
  for (const message of dropped) {
    if (message.role === "user") {
      const parts =
        typeof message.content === "string"
          ? [{ type: "text" as const, text: message.content }]
          : message.content
      for (const part of parts) {
        if (part.type !== "text") continue
        if (part.text.startsWith(SUMMARY_MARK)) {
          const body = part.text.split("\n").slice(1, -1)
          for (const line of body) {
            const touched = /^Files touched: (.*)$/.exec(line)
            if (touched) for (const file of touched[1]!.split(", ")) files.add(file)
            else lines.push(line)
          }
        } else lines.push(`- user: ${clip(part.text, 160)}`)
      }
    } else if (message.role === "assistant" && typeof message.content !== "string") {
      for (const part of message.content) {
        if (part.type !== "tool-call") continue
        const params = (part.params ?? {}) as Record<string, unknown>
        const target =
          typeof params.path === "string"
            ? params.path
            : typeof params.command === "string"
              ? params.command
              : ""
        if (typeof params.path === "string" && part.name !== "list_files" && part.name !== "search")
          files.add(params.path)
        lines.push(`  - ${part.name}${target === "" ? "" : `: ${clip(target, 100)}`}`)
      }
    }
  }
  const tail = files.size > 0 ? [`Files touched: ${[...files].slice(-40).join(", ")}`] : []
  let kept = lines
  const size = () => [SUMMARY_MARK, ...kept, ...tail, "]"].join("\n").length
  while (kept.length > 1 && size() > SUMMARY_MAX_CHARS) kept = kept.slice(1)
  return [SUMMARY_MARK, ...kept, ...tail, "]"].join("\n")
}

/**
 * Keep a conversation under `limit` tokens (estimated): first the results of older tool calls are
 * replaced by a note, then the oldest exchanges (whole user turns) are dropped, the first kept
 * user turn opening with a short summary of them (`summaryOf`). Returns what was
 * done, for the user to see.
 */
export const compact = (
  prompt: Prompt.Prompt,
  limit: number
): { readonly prompt: Prompt.Prompt; readonly note: string | undefined } => {
  const before = estimateTokens(prompt)
  if (before <= limit) return { prompt, note: undefined }
  const messages = [...encodePrompt(prompt).content] as Array<Prompt.MessageEncoded>
  let trimmed = 0
  const trimBefore = Math.max(0, messages.length - KEEP_RECENT_MESSAGES)
  for (let i = 0; i < trimBefore; i++) {
    const message = messages[i]!
    if (message.role !== "tool") continue
    messages[i] = {
      ...message,
      content: message.content.map((part) => {
        if (part.type !== "tool-result") return part
        const result = part.result as Partial<ToolOutput> | undefined
        if (result?.output === TRIMMED) return part
        trimmed++
        return {
          ...part,
          result: {
            output: TRIMMED,
            exitCode: result?.exitCode ?? null,
            truncated: true,
            isError: result?.isError ?? false,
            durationMs: result?.durationMs ?? 0
          }
        }
      })
    }
  }
  let current = Schema.decodeUnknownSync(Prompt.Prompt)({ content: messages })
  let dropped = 0
  const droppedMessages: Array<Prompt.MessageEncoded> = []
  // still too big: drop whole exchanges from the start (each begins with a user message that is not a tool result)
  while (estimateTokens(current) > limit) {
    const content = encodePrompt(current).content
    const next = content.findIndex((message, i) => i > 0 && message.role === "user")
    if (next < 0) break
    dropped += next
    droppedMessages.push(...content.slice(0, next))
    current = Schema.decodeUnknownSync(Prompt.Prompt)({ content: content.slice(next) })
  }
  if (droppedMessages.length > 0) {
    // the first kept message (a user turn) opens with a short summary of what was dropped
    const content = [...encodePrompt(current).content]
    const first = content[0]
    if (first !== undefined && first.role === "user") {
      // an encoded user message with one text part is a plain string
      const parts: ReadonlyArray<Prompt.UserMessagePartEncoded> =
        typeof first.content === "string" ? [{ type: "text", text: first.content }] : first.content
      content[0] = {
        ...first,
        content: [
          { type: "text" as const, text: summaryOf(droppedMessages) },
          ...(stripSummary(parts) as ReadonlyArray<Prompt.UserMessagePartEncoded>)
        ]
      }
      current = Schema.decodeUnknownSync(Prompt.Prompt)({ content })
    }
  }
  const after = estimateTokens(current)
  const parts = [
    ...(trimmed > 0 ? [`trimmed ${trimmed} old tool output${trimmed === 1 ? "" : "s"}`] : []),
    ...(dropped > 0
      ? [`dropped the ${dropped} oldest message${dropped === 1 ? "" : "s"} (a short summary kept)`]
      : [])
  ]
  return {
    prompt: current,
    note: `context compacted (≈${before} → ≈${after} tokens of ${Math.round(limit / COMPACT_AT)}): ${parts.join(", ") || "nothing to trim"}`
  }
}

/** the HTTP status of a provider error, when it has one */
const statusOf = (error: AiError.AiError): number | undefined =>
  error._tag === "HttpResponseError" ? error.response.status : undefined

const retryAfterMs = (error: AiError.AiError): number | undefined => {
  if (error._tag !== "HttpResponseError") return undefined
  const raw = error.response.headers["retry-after"]
  const seconds = raw === undefined ? NaN : Number(raw)
  return Number.isFinite(seconds) && seconds >= 0 ? Math.min(seconds * 1000, MAX_DELAY_MS) : undefined
}

const isRetryable = (error: AiError.AiError): boolean => {
  const status = statusOf(error)
  if (status !== undefined) return status === 408 || status === 429 || status === 529 || status >= 500
  return error._tag === "HttpRequestError" && error.reason === "Transport"
}

/** what the user reads for a model error */
export const describeModelError = (
  error: AiError.AiError,
  spec: ModelSpec,
  refusal: string | undefined
): string => {
  const status = statusOf(error)
  const keyVar = spec.hostVariable ?? "the provider's key variable"
  if ((status === 401 || status === 403) && spec.hostVariable === undefined) {
    return `the model server at ${spec.endpoint} refused the request (${status}); its catalog entry has no key (apiKeyEnv null): set apiKeyEnv in models.json if it needs one`
  }
  if (status === 401 || status === 403) {
    return `the ${spec.provider} API refused the request (${status}): check ${keyVar} on the host (the broker adds it; the guest only sees a placeholder)`
  }
  if (refusal !== undefined) {
    const hint =
      refusal.includes("host-not-allowed") && spec.hostVariable !== undefined
        ? ` (set ${spec.hostVariable} on the host: the provider's broker rule is added when it is)`
        : ""
    return `the broker refused the connection to the model: ${refusal}${hint}`
  }
  const detail = error.message.split("\n")[0] ?? error.message
  return status === undefined
    ? `the model request failed: ${detail}`
    : `the model API answered ${status}: ${detail}`
}

class StepFailed extends Schema.TaggedError<StepFailed>()("StepFailed", {
  message: Schema.String,
  /** the model request's own error (an AiError), when one caused it */
  cause: Schema.optional(Schema.Defect)
}) {}

/**
 * One model request, streamed, with its retries: text deltas, tool calls and tool results become
 * events; a failure after output began is not retried (the stream was cut mid-answer).
 */
const step = (
  prompt: Prompt.Prompt,
  toolkit: AgentToolkitWithHandlers,
  options: LoopOptions
): Effect.Effect<ReadonlyArray<Response.AnyPart>, StepFailed, LanguageModel.LanguageModel> =>
  Effect.gen(function* () {
    for (let attempt = 0; ; attempt++) {
      const parts: Array<Response.AnyPart> = []
      const started = yield* Ref.make(false)
      const outcome = yield* LanguageModel.streamText({
        prompt: Prompt.merge(
          Prompt.make([{ role: "system", content: options.systemPrompt ?? SYSTEM_PROMPT }]),
          prompt
        ),
        toolkit,
        concurrency: 1
      }).pipe(
        Stream.runForEach((part) =>
          Effect.gen(function* () {
            parts.push(part as Response.AnyPart)
            switch (part.type) {
              case "text-delta":
                yield* Ref.set(started, true)
                if (part.delta !== "") yield* options.emit({ kind: "text", delta: part.delta })
                return
              case "tool-call":
                yield* Ref.set(started, true)
                yield* options.emit({ kind: "tool_call", id: part.id, name: part.name, input: part.params })
                return
              case "tool-result": {
                const result: ToolOutput = part.result
                yield* options.emit({
                  kind: "tool_result",
                  id: part.id,
                  name: part.name,
                  exitCode: result.exitCode,
                  output: result.output,
                  truncated: result.truncated,
                  isError: result.isError || part.isFailure,
                  durationMs: result.durationMs
                })
                return
              }
              default:
                return
            }
          })
        ),
        Effect.either
      )
      if (Either.isRight(outcome)) return parts
      const error = outcome.left as AiError.AiError
      const midAnswer = yield* Ref.get(started)
      const refusal = options.lastRefusal()
      if (midAnswer) {
        return yield* new StepFailed({
          message: `the model's stream was cut mid-answer: ${describeModelError(error, options.spec, refusal)}`,
          cause: error
        })
      }
      if (refusal !== undefined || !isRetryable(error) || attempt >= MAX_RETRIES) {
        return yield* new StepFailed({ message: describeModelError(error, options.spec, refusal), cause: error })
      }
      const delayMs = retryAfterMs(error) ?? Math.min(BASE_DELAY_MS * 2 ** attempt, MAX_DELAY_MS)
      const status = statusOf(error)
      yield* options.emit({
        kind: "retry",
        attempt: attempt + 1,
        delayMs,
        reason: status === undefined ? (error.message.split("\n")[0] ?? error._tag) : `HTTP ${status}`
      })
      yield* Effect.sleep(delayMs)
    }
  })

export interface Conversation {
  prompt: Prompt.Prompt
}

/** US dollars for these tokens at the spec's prices (per million); undefined without prices */
export const costOf = (spec: ModelSpec, input: number, output: number): number | undefined =>
  spec.inputPrice !== undefined && spec.outputPrice !== undefined
    ? (input * spec.inputPrice + output * spec.outputPrice) / 1_000_000
    : undefined

const dollars = (usd: number) => `$${usd < 0.01 ? usd.toFixed(4) : usd.toFixed(2)}`

export const SUMMARY_HEADER =
  "[Summary of the earlier conversation, written when the context window filled up; the exchanges it replaces were dropped]"
const SUMMARY_REQUEST = `The conversation above is about to be dropped to fit the context window; only your summary of it will remain. Write that summary for yourself, to carry on the work without it: the user's requests and their intent, what was done and found (files read or changed, commands run and their results, errors and how they were solved), the decisions taken, and what is still to do. Be specific (paths, names, numbers); leave out what no longer matters. Answer with the summary only.`
/** characters of one message's text in the summary request's transcript */
const TRANSCRIPT_PART_CHARS = 4000

/** the messages as a plain transcript for the summary request (each part clipped) */
export const transcriptOf = (messages: ReadonlyArray<Prompt.MessageEncoded>): string => {
  const clipPart = (text: string) =>
    text.length > TRANSCRIPT_PART_CHARS
      ? `${text.slice(0, TRANSCRIPT_PART_CHARS / 2)}\n[… ${text.length - TRANSCRIPT_PART_CHARS} characters cut …]\n${text.slice(-TRANSCRIPT_PART_CHARS / 2)}`
      : text
  const out: Array<string> = []
  for (const message of messages) {
    if (message.role === "system") continue
    const parts =
      typeof message.content === "string" ? [{ type: "text", text: message.content }] : message.content
    for (const part of parts as ReadonlyArray<Record<string, unknown>>) {
      if (part.type === "text" && typeof part.text === "string") {
        out.push(`${message.role}: ${clipPart(part.text)}`)
      } else if (part.type === "tool-call") {
        out.push(`assistant called ${String(part.name)}: ${clipPart(JSON.stringify(part.params ?? {}))}`)
      } else if (part.type === "tool-result") {
        const result = part.result as Partial<ToolOutput> | undefined
        const text = typeof result?.output === "string" ? result.output : JSON.stringify(part.result)
        out.push(
          `${String(part.name)} result${result?.isError === true ? " (error)" : ""}: ${clipPart(text)}`
        )
      }
    }
  }
  return out.join("\n\n")
}

/**
 * Where the summary ends and the kept messages begin: the current user request and what followed
 * it are kept; a turn that alone fills the window keeps its last `KEEP_RECENT_MESSAGES` messages
 * from an assistant message on (a tool result never loses its call). Undefined: nothing to summarise.
 */
export const summarySplit = (messages: ReadonlyArray<Prompt.MessageEncoded>): number | undefined => {
  const lastUser = messages.findLastIndex((message) => message.role === "user")
  if (lastUser > 0) return lastUser
  for (let i = messages.length - KEEP_RECENT_MESSAGES; i >= 1; i--) {
    if (messages[i]!.role === "assistant") return i
  }
  return undefined
}

/**
 * Compaction by the model: the messages before `summarySplit` are sent as a transcript with a
 * request for a summary, which replaces them (opening the first kept user message, or as a user
 * message of its own before a kept assistant message). Fails when the request does (the caller
 * then trims instead); the request's usage is returned to be counted. Undefined: nothing to
 * summarise (one exchange fills the window: it is trimmed).
 */
const summarise = (
  prompt: Prompt.Prompt,
  limit: number
): Effect.Effect<
  | {
      readonly prompt: Prompt.Prompt
      readonly summarised: number
      readonly input: number
      readonly output: number
    }
  | undefined,
  AiError.AiError | StepFailed,
  LanguageModel.LanguageModel
> =>
  Effect.gen(function* () {
    const messages = encodePrompt(prompt).content as ReadonlyArray<Prompt.MessageEncoded>
    const split = summarySplit(messages)
    if (split === undefined) return undefined
    // the transcript itself stays well inside the window (4 characters a token)
    const transcript = capTranscript(transcriptOf(messages.slice(0, split)), limit * 2)
    const response = yield* LanguageModel.generateText({
      prompt: [
        {
          role: "system",
          content:
            "You summarise a coding agent's conversation so that the agent can carry on from the summary alone."
        },
        { role: "user", content: `<conversation>\n${transcript}\n</conversation>\n\n${SUMMARY_REQUEST}` }
      ]
    })
    const summary = response.text.trim()
    if (summary === "") return yield* new StepFailed({ message: "the summary came back empty" })
    const header = { type: "text" as const, text: `${SUMMARY_HEADER}\n${summary}` }
    const kept = [...messages.slice(split)]
    const first = kept[0]!
    if (first.role === "user") {
      const parts: ReadonlyArray<Prompt.UserMessagePartEncoded> =
        typeof first.content === "string" ? [{ type: "text", text: first.content }] : first.content
      kept[0] = { ...first, content: [header, ...parts] }
    } else kept.unshift({ role: "user", content: [header] })
    return {
      prompt: Schema.decodeUnknownSync(Prompt.Prompt)({ content: kept }),
      summarised: split,
      input: response.usage.inputTokens ?? 0,
      output: response.usage.outputTokens ?? 0
    }
  })

const capTranscript = (text: string, max: number) =>
  text.length <= max
    ? text
    : `${text.slice(0, max / 4)}\n[… earlier part cut …]\n${text.slice(-(max * 3) / 4)}`

/**
 * One prompt turn over `conversation` (updated in place after each completed step). Usage is
 * emitted once at the end (tokens of every request; cost when the spec has prices).
 */
export const promptTurn = (
  text: string,
  conversation: Conversation,
  toolkit: AgentToolkitWithHandlers,
  options: LoopOptions
): Effect.Effect<TurnSummary, never, LanguageModel.LanguageModel> =>
  Effect.gen(function* () {
    const { maxCostUsd } = options
    if (maxCostUsd !== undefined && costOf(options.spec, 0, 0) === undefined) {
      return {
        reason: "error" as const,
        steps: 0,
        message: `a spending limit (max cost) needs the model's prices, and the model catalog has none for ${options.spec.id}: set inputPrice and outputPrice (US dollars per million tokens) in its models.json entry`
      }
    }
    conversation.prompt = Prompt.merge(conversation.prompt, Prompt.make([{ role: "user", content: text }]))
    const usage = { input: 0, output: 0 }
    const limit = Math.floor((options.spec.contextWindow ?? 128_000) * COMPACT_AT)
    const emitUsage = Effect.suspend(() => {
      if (usage.input === 0 && usage.output === 0) return Effect.void
      const cost = costOf(options.spec, usage.input, usage.output)
      return options.emit({
        kind: "usage",
        model: options.spec.id,
        inputTokens: usage.input,
        outputTokens: usage.output,
        ...(cost === undefined ? {} : { costUsd: Math.round(cost * 1e6) / 1e6 })
      })
    })
    let steps = 0
    const summary: TurnSummary = yield* Effect.gen(function* () {
      for (;;) {
        if (steps >= options.maxSteps) {
          return {
            reason: "max_steps" as const,
            steps,
            message: `stopped after ${steps} model requests (max steps)`
          }
        }
        if (estimateTokens(conversation.prompt) > limit) {
          const before = estimateTokens(conversation.prompt)
          const window = Math.round(limit / COMPACT_AT)
          const summarised = yield* Effect.either(summarise(conversation.prompt, limit))
          if (Either.isRight(summarised) && summarised.right === undefined) {
            const compacted = compact(conversation.prompt, limit)
            conversation.prompt = compacted.prompt
            if (compacted.note !== undefined) yield* options.emit({ kind: "status", message: compacted.note })
          } else if (Either.isRight(summarised) && summarised.right !== undefined) {
            usage.input += summarised.right.input
            usage.output += summarised.right.output
            // a kept exchange that is still too big has its older tool outputs trimmed too
            const trimmed = compact(summarised.right.prompt, limit)
            conversation.prompt = trimmed.prompt
            yield* options.emit({
              kind: "status",
              message: `context compacted (≈${before} → ≈${estimateTokens(conversation.prompt)} tokens of ${window}): the model summarised the ${summarised.right.summarised} earlier message${summarised.right.summarised === 1 ? "" : "s"}`
            })
          } else if (Either.isLeft(summarised)) {
            const why =
              summarised.left._tag === "StepFailed"
                ? summarised.left.message
                : describeModelError(summarised.left, options.spec, options.lastRefusal())
            const compacted = compact(conversation.prompt, limit)
            conversation.prompt = compacted.prompt
            yield* options.emit({
              kind: "status",
              message: `the summary for compaction failed (${why}); ${compacted.note ?? "nothing to trim"}`
            })
          }
          if (options.onStep !== undefined) yield* options.onStep()
        }
        steps++
        const parts = yield* step(conversation.prompt, toolkit, options)
        conversation.prompt = Prompt.merge(conversation.prompt, Prompt.fromResponseParts(parts))
        if (options.onStep !== undefined) yield* options.onStep()
        const finish = parts.find((part): part is Response.FinishPart => part.type === "finish")
        usage.input += finish?.usage.inputTokens ?? 0
        usage.output += finish?.usage.outputTokens ?? 0
        const calledTools = parts.some((part) => part.type === "tool-call")
        if (!calledTools) return { reason: "done" as const, steps }
        const spent = costOf(options.spec, usage.input, usage.output)
        if (maxCostUsd !== undefined && spent !== undefined && spent >= maxCostUsd) {
          return {
            reason: "max_cost" as const,
            steps,
            message: `stopped after ${steps} model request${steps === 1 ? "" : "s"}: spent ${dollars(spent)} of the ${dollars(maxCostUsd)} limit (max cost)`
          }
        }
      }
    }).pipe(
      Effect.catchTag("StepFailed", (error) =>
        Effect.succeed({ reason: "error" as const, steps, message: error.message })
      ),
      Effect.onInterrupt(() => emitUsage)
    )
    yield* emitUsage
    return summary
  })
