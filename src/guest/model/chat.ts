/**
 * The OpenAI Chat Completions API (`POST {endpoint}/chat/completions`, streamed SSE) as a
 * LanguageModel: what OpenAI-compatible servers speak (llama.cpp's server, vLLM, Ollama …) when
 * they lack the Responses API that @effect/ai-openai's own LanguageModel calls. The request goes
 * through OpenAiClient's `streamRequest` (its base URL, bearer placeholder, SSE decoding and
 * typed errors); only the prompt ↔ message mapping and the chunk decoding live here.
 */
import * as OpenAiClient from "@effect/ai-openai/OpenAiClient"
import * as AiError from "@effect/ai/AiError"
import * as LanguageModel from "@effect/ai/LanguageModel"
import type * as Prompt from "@effect/ai/Prompt"
import type * as Response from "@effect/ai/Response"
import * as Tool from "@effect/ai/Tool"
import * as HttpBody from "@effect/platform/HttpBody"
import * as HttpClientRequest from "@effect/platform/HttpClientRequest"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"

const ToolCallDelta = Schema.Struct({
  index: Schema.Number,
  id: Schema.optional(Schema.NullOr(Schema.String)),
  function: Schema.optional(
    Schema.Struct({
      name: Schema.optional(Schema.NullOr(Schema.String)),
      arguments: Schema.optional(Schema.NullOr(Schema.String))
    })
  )
})

/** one streamed chunk (`chat.completion.chunk`); fields a server may leave out are optional */
export const ChatChunk = Schema.Struct({
  id: Schema.optional(Schema.String),
  model: Schema.optional(Schema.String),
  choices: Schema.Array(
    Schema.Struct({
      index: Schema.optional(Schema.Number),
      delta: Schema.optional(
        Schema.Struct({
          content: Schema.optional(Schema.NullOr(Schema.String)),
          tool_calls: Schema.optional(Schema.NullOr(Schema.Array(ToolCallDelta)))
        })
      ),
      finish_reason: Schema.optional(Schema.NullOr(Schema.String))
    })
  ),
  usage: Schema.optional(
    Schema.NullOr(
      Schema.Struct({
        prompt_tokens: Schema.optional(Schema.Number),
        completion_tokens: Schema.optional(Schema.Number)
      })
    )
  )
})

type ChatMessage =
  | { readonly role: "system" | "user"; readonly content: string }
  | {
      readonly role: "assistant"
      readonly content: string | null
      readonly tool_calls?: ReadonlyArray<{
        readonly id: string
        readonly type: "function"
        readonly function: { readonly name: string; readonly arguments: string }
      }>
    }
  | { readonly role: "tool"; readonly tool_call_id: string; readonly content: string }

const resultText = (result: unknown): string => (typeof result === "string" ? result : JSON.stringify(result))

/** the prompt as chat messages (text parts only; files and reasoning are not sent) */
export const chatMessages = (prompt: Prompt.Prompt): Array<ChatMessage> => {
  const out: Array<ChatMessage> = []
  for (const message of prompt.content) {
    switch (message.role) {
      case "system":
        out.push({ role: "system", content: message.content })
        break
      case "user":
        out.push({
          role: "user",
          content: message.content.flatMap((part) => (part.type === "text" ? [part.text] : [])).join("")
        })
        break
      case "assistant": {
        let text = ""
        const calls: Array<{ id: string; type: "function"; function: { name: string; arguments: string } }> =
          []
        const results: Array<ChatMessage> = []
        for (const part of message.content) {
          if (part.type === "text") text += part.text
          else if (part.type === "tool-call") {
            calls.push({
              id: part.id,
              type: "function",
              function: { name: part.name, arguments: JSON.stringify(part.params ?? {}) }
            })
          } else if (part.type === "tool-result") {
            results.push({ role: "tool", tool_call_id: part.id, content: resultText(part.result) })
          }
        }
        out.push({
          role: "assistant",
          content: text === "" ? null : text,
          ...(calls.length > 0 ? { tool_calls: calls } : {})
        })
        out.push(...results)
        break
      }
      case "tool":
        for (const part of message.content) {
          out.push({ role: "tool", tool_call_id: part.id, content: resultText(part.result) })
        }
        break
    }
  }
  return out
}

const finishReason = (reason: string | null | undefined, hasToolCalls: boolean): Response.FinishReason =>
  hasToolCalls || reason === "tool_calls" || reason === "function_call"
    ? "tool-calls"
    : reason === "length"
      ? "length"
      : reason === "content_filter"
        ? "content-filter"
        : reason === "stop" || reason === undefined || reason === null
          ? "stop"
          : "other"

const malformed = (description: string) =>
  new AiError.MalformedOutput({ module: "ChatCompletions", method: "streamText", description })

export interface ChatConfig {
  readonly model: string
  readonly maxTokens?: number | undefined
}

export const make = (config: ChatConfig) =>
  Effect.gen(function* () {
    const client = yield* OpenAiClient.OpenAiClient
    const body = (options: LanguageModel.ProviderOptions) => {
      const tools = options.tools.filter(Tool.isUserDefined).map((tool) => ({
        type: "function" as const,
        function: {
          name: tool.name,
          description: Tool.getDescription(tool as never),
          parameters: Tool.getJsonSchema(tool as never)
        }
      }))
      return {
        model: config.model,
        messages: chatMessages(options.prompt),
        stream: true,
        stream_options: { include_usage: true },
        ...(config.maxTokens === undefined ? {} : { max_tokens: config.maxTokens }),
        ...(tools.length > 0
          ? {
              tools,
              tool_choice:
                options.toolChoice === "none"
                  ? "none"
                  : options.toolChoice === "required"
                    ? "required"
                    : "auto"
            }
          : {})
      }
    }
    const streamText = (
      options: LanguageModel.ProviderOptions
    ): Stream.Stream<Response.StreamPartEncoded, AiError.AiError> =>
      Stream.suspend(() => {
        const request = HttpClientRequest.post("/chat/completions", {
          body: HttpBody.unsafeJson(body(options))
        })
        const calls = new Map<number, { id: string; name: string; args: string }>()
        let textOpen = false
        let reason: string | null | undefined
        let usage: { prompt_tokens?: number | undefined; completion_tokens?: number | undefined } | undefined
        const textId = "text-0"
        const events = client.streamRequest(request, ChatChunk).pipe(
          Stream.mapConcat((chunk) => {
            const parts: Array<Response.StreamPartEncoded> = []
            if (chunk.usage) usage = chunk.usage
            for (const choice of chunk.choices) {
              const content = choice.delta?.content
              if (content !== undefined && content !== null && content !== "") {
                if (!textOpen) {
                  textOpen = true
                  parts.push({ type: "text-start", id: textId })
                }
                parts.push({ type: "text-delta", id: textId, delta: content })
              }
              for (const delta of choice.delta?.tool_calls ?? []) {
                const known = calls.get(delta.index)
                if (known === undefined) {
                  calls.set(delta.index, {
                    id: delta.id ?? `call_${delta.index}`,
                    name: delta.function?.name ?? "",
                    args: delta.function?.arguments ?? ""
                  })
                } else {
                  if (delta.function?.name) known.name += delta.function.name
                  if (delta.function?.arguments) known.args += delta.function.arguments
                }
              }
              if (choice.finish_reason !== undefined && choice.finish_reason !== null)
                reason = choice.finish_reason
            }
            return parts
          })
        )
        const end = Effect.suspend(() => {
          const parts: Array<Response.StreamPartEncoded> = []
          if (textOpen) parts.push({ type: "text-end", id: textId })
          for (const call of [...calls.entries()].sort(([a], [b]) => a - b).map(([, c]) => c)) {
            let params: unknown
            try {
              params = call.args.trim() === "" ? {} : JSON.parse(call.args)
            } catch {
              return Effect.fail(
                malformed(`the arguments of tool call ${call.id} (${call.name}) are not JSON`)
              )
            }
            parts.push({ type: "tool-call", id: call.id, name: call.name, params })
          }
          if (reason === undefined && calls.size === 0 && !textOpen) {
            return Effect.fail(malformed("the chat completion stream ended without a choice"))
          }
          parts.push({
            type: "finish",
            reason: finishReason(reason, calls.size > 0),
            usage: {
              inputTokens: usage?.prompt_tokens,
              outputTokens: usage?.completion_tokens,
              totalTokens: (usage?.prompt_tokens ?? 0) + (usage?.completion_tokens ?? 0)
            }
          })
          return Effect.succeed(parts)
        })
        return Stream.concat(events, Stream.flatMap(Stream.fromEffect(end), Stream.fromIterable))
      })
    return yield* LanguageModel.make({
      streamText,
      generateText: (options) =>
        streamText(options).pipe(
          Stream.runCollect,
          Effect.map((chunk) => {
            // the collected stream as whole parts: text joined, tool calls and the finish as they are
            const out: Array<Response.PartEncoded> = []
            let text = ""
            for (const part of chunk) {
              if (part.type === "text-delta") text += part.delta
              else if (part.type === "tool-call" || part.type === "finish")
                out.push(part as Response.PartEncoded)
            }
            return text === "" ? out : [{ type: "text", text } as Response.PartEncoded, ...out]
          })
        )
    })
  })

export const layer = (
  config: ChatConfig
): Layer.Layer<LanguageModel.LanguageModel, never, OpenAiClient.OpenAiClient> =>
  Layer.effect(LanguageModel.LanguageModel, make(config))
