/**
 * A scripted stand-in for the model providers' HTTP APIs, served over HTTPS on 127.0.0.1 with a
 * certificate from its own test CA (any SNI name gets a leaf), so that tests reach it through
 * the broker by the policy's `resolve` (or over plain HTTP, `plain: true`, a local model server
 * the broker reaches by a `localHttp` rule):
 *
 * - Anthropic Messages API: `POST /v1/messages` (streamed SSE when the body says `stream: true`,
 *   else one JSON message), errors as `{type:"error", error:{type, message}}`.
 * - OpenAI Responses API (what @effect/ai-openai calls): `POST /v1/responses` (SSE events
 *   `response.*`, else one JSON response), errors as `{error:{message, type, code}}`.
 * - OpenAI Chat Completions API (what OpenAI-compatible local servers speak):
 *   `POST /v1/chat/completions` (SSE `chat.completion.chunk`s with `tool_calls` deltas, then
 *   `data: [DONE]`; else one `chat.completion`), errors as the Responses API's.
 *
 * Each request takes the next step of the script; every request is recorded (method, path,
 * headers, parsed body) for assertions. Nothing is echoed back from a request's headers.
 */
import * as http from "node:http"
import type { IncomingMessage, ServerResponse } from "node:http"
import * as https from "node:https"
import type * as net from "node:net"
import { performance } from "node:perf_hooks"
import * as tls from "node:tls"
import { makeSessionCa } from "../../src/broker/ca.js"

export interface MockToolCall {
  readonly id?: string
  readonly name: string
  readonly input: Record<string, unknown>
}

export interface MockUsage {
  readonly input: number
  readonly output: number
}

export type MockStep =
  /** an answer: text streamed in these chunks (one delta each), then the end of the message */
  | {
      readonly kind: "text"
      readonly chunks: ReadonlyArray<string>
      readonly usage?: MockUsage
      /** pause before each chunk (a slow stream) */
      readonly delayMs?: number
      /** pause between the last event and the end of the response body */
      readonly endDelayMs?: number
    }
  /** the model asks for tools (optionally after some text) */
  | {
      readonly kind: "tools"
      readonly calls: ReadonlyArray<MockToolCall>
      readonly text?: string
      readonly usage?: MockUsage
    }
  /** an HTTP error with the provider's error body */
  | {
      readonly kind: "error"
      readonly status: number
      readonly message?: string
      readonly retryAfter?: number
    }
  /** the stream starts, sends these chunks, then the connection is cut */
  | { readonly kind: "cut"; readonly chunks: ReadonlyArray<string> }
  /** the stream starts and sends these chunks, then hangs until the client goes away */
  | { readonly kind: "hang"; readonly chunks: ReadonlyArray<string> }

export interface MockRequest {
  /** performance.now() when the request's head arrived, and when its answer ended */
  readonly arrivedAt: number
  endedAt?: number
  readonly method: string
  readonly path: string
  readonly headers: Readonly<Record<string, string | ReadonlyArray<string> | undefined>>
  readonly body: unknown
}

export type Provider = "anthropic" | "openai" | "chat"

const sse = (event: string, data: unknown): string => `event: ${event}\ndata: ${JSON.stringify(data)}\n\n`

const anthropicErrorType = (status: number): string =>
  status === 400
    ? "invalid_request_error"
    : status === 401
      ? "authentication_error"
      : status === 403
        ? "permission_error"
        : status === 404
          ? "not_found_error"
          : status === 429
            ? "rate_limit_error"
            : status === 529
              ? "overloaded_error"
              : "api_error"

const anthropicUsage = (usage: MockUsage | undefined, output?: number) => ({
  input_tokens: usage?.input ?? 10,
  cache_creation_input_tokens: 0,
  cache_read_input_tokens: 0,
  output_tokens: output ?? usage?.output ?? 5
})

/** the blocks of an Anthropic answer for a step (text first, then tool uses) */
const anthropicBlocks = (step: MockStep, counter: () => number) => {
  if (step.kind === "text" || step.kind === "cut" || step.kind === "hang") {
    return [{ type: "text" as const, text: step.chunks.join(""), chunks: step.chunks }]
  }
  if (step.kind !== "tools") return []
  return [
    ...(step.text === undefined ? [] : [{ type: "text" as const, text: step.text, chunks: [step.text] }]),
    ...step.calls.map((call) => ({
      type: "tool_use" as const,
      id: call.id ?? `toolu_${String(counter()).padStart(4, "0")}`,
      name: call.name,
      input: call.input
    }))
  ]
}

const openAiUsage = (usage: MockUsage | undefined) => ({
  input_tokens: usage?.input ?? 10,
  input_tokens_details: { cached_tokens: 0 },
  output_tokens: usage?.output ?? 5,
  output_tokens_details: { reasoning_tokens: 0 },
  total_tokens: (usage?.input ?? 10) + (usage?.output ?? 5)
})

/** what was written reaches the client, then the connection drops without the stream's end */
const cut = (res: ServerResponse) =>
  new Promise<void>((resolve) =>
    res.write("", () => {
      setTimeout(() => {
        res.socket?.destroy()
        resolve()
      }, 20)
    })
  )

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms))

export const startModelMock = async (
  options: {
    readonly names?: ReadonlyArray<string>
    /** plain HTTP instead of HTTPS (a local model server such as Ollama or llama.cpp's) */
    readonly plain?: boolean
  } = {}
) => {
  const ca = await makeSessionCa({ commonName: "abox test model CA" })
  const first = ca.leaf(options.names?.[0] ?? "localhost")
  const script: Array<MockStep> = []
  const requests: Array<MockRequest> = []
  let ids = 0
  const counter = () => ++ids
  /** resolved by `untilRequest` waiters */
  const waiters: Array<{ readonly n: number; readonly resolve: () => void }> = []

  const anthropic = async (req: MockRequest, res: ServerResponse, step: MockStep) => {
    const body = (req.body ?? {}) as { model?: string; stream?: boolean }
    const model = body.model ?? "mock-model"
    if (step.kind === "error") {
      res.writeHead(step.status, {
        "content-type": "application/json",
        "request-id": `req_${counter()}`,
        ...(step.retryAfter === undefined ? {} : { "retry-after": String(step.retryAfter) })
      })
      res.end(
        JSON.stringify({
          type: "error",
          error: {
            type: anthropicErrorType(step.status),
            message: step.message ?? `mock error ${step.status}`
          }
        })
      )
      return
    }
    const id = `msg_${String(counter()).padStart(4, "0")}`
    const blocks = anthropicBlocks(step, counter)
    const usage = step.kind === "text" || step.kind === "tools" ? step.usage : undefined
    const stopReason = step.kind === "tools" ? "tool_use" : "end_turn"
    if (body.stream !== true) {
      res.writeHead(200, { "content-type": "application/json" })
      res.end(
        JSON.stringify({
          id,
          type: "message",
          role: "assistant",
          model,
          content: blocks.map((block) =>
            block.type === "text"
              ? { type: "text", text: block.text }
              : { type: "tool_use", id: block.id, name: block.name, input: block.input }
          ),
          stop_reason: stopReason,
          stop_sequence: null,
          usage: anthropicUsage(usage)
        })
      )
      return
    }
    res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" })
    res.write(
      sse("message_start", {
        type: "message_start",
        message: {
          id,
          type: "message",
          role: "assistant",
          model,
          content: [],
          stop_reason: null,
          stop_sequence: null,
          usage: anthropicUsage(usage, 1)
        }
      })
    )
    for (const [index, block] of blocks.entries()) {
      if (block.type === "text") {
        res.write(
          sse("content_block_start", {
            type: "content_block_start",
            index,
            content_block: { type: "text", text: "" }
          })
        )
        for (const chunk of block.chunks) {
          if (step.kind === "text" && step.delayMs !== undefined) await sleep(step.delayMs)
          if (res.destroyed) return
          res.write(
            sse("content_block_delta", {
              type: "content_block_delta",
              index,
              delta: { type: "text_delta", text: chunk }
            })
          )
        }
        if (step.kind === "cut") return cut(res)
        if (step.kind === "hang") return
      } else {
        res.write(
          sse("content_block_start", {
            type: "content_block_start",
            index,
            content_block: { type: "tool_use", id: block.id, name: block.name, input: {} }
          })
        )
        const json = JSON.stringify(block.input)
        const half = Math.floor(json.length / 2)
        for (const part of [json.slice(0, half), json.slice(half)]) {
          res.write(
            sse("content_block_delta", {
              type: "content_block_delta",
              index,
              delta: { type: "input_json_delta", partial_json: part }
            })
          )
        }
      }
      res.write(sse("content_block_stop", { type: "content_block_stop", index }))
    }
    res.write(
      sse("message_delta", {
        type: "message_delta",
        delta: { stop_reason: stopReason, stop_sequence: null },
        usage: { output_tokens: usage?.output ?? 5 }
      })
    )
    res.write(sse("message_stop", { type: "message_stop" }))
    if (step.kind === "text" && step.endDelayMs !== undefined) await sleep(step.endDelayMs)
    res.end()
  }

  const openai = async (req: MockRequest, res: ServerResponse, step: MockStep) => {
    const body = (req.body ?? {}) as { model?: string; stream?: boolean }
    const model = body.model ?? "mock-model"
    if (step.kind === "error") {
      res.writeHead(step.status, {
        "content-type": "application/json",
        "x-request-id": `req_${counter()}`,
        ...(step.retryAfter === undefined ? {} : { "retry-after": String(step.retryAfter) })
      })
      res.end(
        JSON.stringify({
          error: {
            message: step.message ?? `mock error ${step.status}`,
            type:
              step.status === 401
                ? "invalid_request_error"
                : step.status === 429
                  ? "requests"
                  : "server_error",
            param: null,
            code: step.status === 401 ? "invalid_api_key" : null
          }
        })
      )
      return
    }
    const id = `resp_${String(counter()).padStart(4, "0")}`
    const createdAt = Math.floor(Date.now() / 1000)
    const usage = step.kind === "text" || step.kind === "tools" ? step.usage : undefined
    const texts = step.kind === "tools" ? (step.text === undefined ? [] : [[step.text]]) : [step.chunks]
    const calls =
      step.kind === "tools"
        ? step.calls.map((call) => ({
            id: `fc_${String(counter()).padStart(4, "0")}`,
            call_id: call.id ?? `call_${String(counter()).padStart(4, "0")}`,
            name: call.name,
            arguments: JSON.stringify(call.input)
          }))
        : []
    const messageItem = (itemId: string, text: string, status: string) => ({
      type: "message",
      id: itemId,
      status,
      role: "assistant",
      content: status === "completed" ? [{ type: "output_text", text, annotations: [], logprobs: [] }] : []
    })
    const callItem = (call: (typeof calls)[number], status: string) => ({
      type: "function_call",
      id: call.id,
      call_id: call.call_id,
      name: call.name,
      arguments: status === "completed" ? call.arguments : "",
      status
    })
    const messageIds = texts.map(() => `msg_${String(counter()).padStart(4, "0")}`)
    const output = [
      ...texts.map((chunks, i) => messageItem(messageIds[i]!, chunks.join(""), "completed")),
      ...calls.map((call) => callItem(call, "completed"))
    ]
    const response = (status: string, out: ReadonlyArray<unknown>) => ({
      id,
      object: "response",
      created_at: createdAt,
      status,
      error: null,
      incomplete_details: null,
      instructions: null,
      max_output_tokens: null,
      model,
      output: out,
      parallel_tool_calls: true,
      previous_response_id: null,
      reasoning: { effort: null, summary: null },
      store: false,
      temperature: 1,
      text: { format: { type: "text" } },
      tool_choice: "auto",
      tools: [],
      top_p: 1,
      truncation: "disabled",
      usage: status === "completed" ? openAiUsage(usage) : null,
      user: null,
      metadata: {}
    })
    if (body.stream !== true) {
      res.writeHead(200, { "content-type": "application/json" })
      res.end(JSON.stringify(response("completed", output)))
      return
    }
    res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" })
    let seq = 0
    const event = (type: string, data: Record<string, unknown>) =>
      res.write(sse(type, { type, sequence_number: seq++, ...data }))
    event("response.created", { response: response("in_progress", []) })
    event("response.in_progress", { response: response("in_progress", []) })
    let outputIndex = 0
    for (const [i, chunks] of texts.entries()) {
      const itemId = messageIds[i]!
      event("response.output_item.added", {
        output_index: outputIndex,
        item: messageItem(itemId, "", "in_progress")
      })
      event("response.content_part.added", {
        item_id: itemId,
        output_index: outputIndex,
        content_index: 0,
        part: { type: "output_text", text: "", annotations: [], logprobs: [] }
      })
      for (const chunk of chunks) {
        if (step.kind === "text" && step.delayMs !== undefined) await sleep(step.delayMs)
        if (res.destroyed) return
        event("response.output_text.delta", {
          item_id: itemId,
          output_index: outputIndex,
          content_index: 0,
          delta: chunk,
          logprobs: []
        })
      }
      if (step.kind === "cut") return cut(res)
      if (step.kind === "hang") return
      const text = chunks.join("")
      event("response.output_text.done", {
        item_id: itemId,
        output_index: outputIndex,
        content_index: 0,
        text,
        logprobs: []
      })
      event("response.content_part.done", {
        item_id: itemId,
        output_index: outputIndex,
        content_index: 0,
        part: { type: "output_text", text, annotations: [], logprobs: [] }
      })
      event("response.output_item.done", {
        output_index: outputIndex,
        item: messageItem(itemId, text, "completed")
      })
      outputIndex++
    }
    for (const call of calls) {
      event("response.output_item.added", { output_index: outputIndex, item: callItem(call, "in_progress") })
      event("response.function_call_arguments.delta", {
        item_id: call.id,
        output_index: outputIndex,
        delta: call.arguments
      })
      event("response.function_call_arguments.done", {
        item_id: call.id,
        output_index: outputIndex,
        name: call.name,
        arguments: call.arguments
      })
      event("response.output_item.done", { output_index: outputIndex, item: callItem(call, "completed") })
      outputIndex++
    }
    event("response.completed", { response: response("completed", output) })
    res.end()
  }

  const chat = async (req: MockRequest, res: ServerResponse, step: MockStep) => {
    // errors have the same shape on both OpenAI APIs
    if (step.kind === "error") return openai(req, res, step)
    const body = (req.body ?? {}) as { model?: string; stream?: boolean }
    const model = body.model ?? "mock-model"
    const id = `chatcmpl-${String(counter()).padStart(4, "0")}`
    const created = Math.floor(Date.now() / 1000)
    const usage = step.kind === "text" || step.kind === "tools" ? step.usage : undefined
    const chatUsage = {
      prompt_tokens: usage?.input ?? 10,
      completion_tokens: usage?.output ?? 5,
      total_tokens: (usage?.input ?? 10) + (usage?.output ?? 5)
    }
    const chunks = step.kind === "tools" ? (step.text === undefined ? [] : [step.text]) : step.chunks
    const calls =
      step.kind === "tools"
        ? step.calls.map((call) => ({
            id: call.id ?? `call_${String(counter()).padStart(4, "0")}`,
            type: "function" as const,
            function: { name: call.name, arguments: JSON.stringify(call.input) }
          }))
        : []
    const finish = calls.length > 0 ? "tool_calls" : "stop"
    if (body.stream !== true) {
      res.writeHead(200, { "content-type": "application/json" })
      res.end(
        JSON.stringify({
          id,
          object: "chat.completion",
          created,
          model,
          choices: [
            {
              index: 0,
              message: {
                role: "assistant",
                content: chunks.length === 0 ? null : chunks.join(""),
                refusal: null,
                ...(calls.length > 0 ? { tool_calls: calls } : {})
              },
              logprobs: null,
              finish_reason: finish
            }
          ],
          usage: chatUsage
        })
      )
      return
    }
    res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" })
    const chunk = (
      delta: Record<string, unknown>,
      finishReason: string | null,
      extra: Record<string, unknown> = {}
    ) =>
      res.write(
        `data: ${JSON.stringify({
          id,
          object: "chat.completion.chunk",
          created,
          model,
          system_fingerprint: null,
          choices: [{ index: 0, delta, logprobs: null, finish_reason: finishReason }],
          ...extra
        })}\n\n`
      )
    chunk({ role: "assistant", content: "" }, null)
    for (const text of chunks) {
      if (step.kind === "text" && step.delayMs !== undefined) await sleep(step.delayMs)
      if (res.destroyed) return
      chunk({ content: text }, null)
    }
    if (step.kind === "cut") return cut(res)
    if (step.kind === "hang") return
    for (const [index, call] of calls.entries()) {
      const args = call.function.arguments
      const half = Math.floor(args.length / 2)
      chunk(
        {
          tool_calls: [
            {
              index,
              id: call.id,
              type: "function",
              function: { name: call.function.name, arguments: args.slice(0, half) }
            }
          ]
        },
        null
      )
      chunk({ tool_calls: [{ index, function: { arguments: args.slice(half) } }] }, null)
    }
    chunk({}, finish)
    // the usage chunk (stream_options.include_usage): no choices
    res.write(
      `data: ${JSON.stringify({ id, object: "chat.completion.chunk", created, model, system_fingerprint: null, choices: [], usage: chatUsage })}\n\n`
    )
    if (step.kind === "text" && step.endDelayMs !== undefined) await sleep(step.endDelayMs)
    res.end("data: [DONE]\n\n")
  }

  const handler = (req: IncomingMessage, res: ServerResponse) => {
    const arrivedAt = performance.now()
    const chunks: Array<Buffer> = []
    req.on("data", (chunk: Buffer) => chunks.push(chunk))
    req.on("end", () => {
      let body: unknown = undefined
      try {
        body = chunks.length === 0 ? undefined : JSON.parse(Buffer.concat(chunks).toString("utf8"))
      } catch {
        body = Buffer.concat(chunks).toString("utf8")
      }
      const url = new URL(req.url ?? "/", "https://mock")
      const recorded: MockRequest = {
        arrivedAt,
        method: req.method ?? "",
        path: url.pathname,
        headers: { ...req.headers },
        body
      }
      requests.push(recorded)
      res.once("finish", () => {
        recorded.endedAt = performance.now()
      })
      for (const waiter of waiters.splice(0)) {
        if (requests.length >= waiter.n) waiter.resolve()
        else waiters.push(waiter)
      }
      const provider: Provider | undefined =
        url.pathname === "/v1/messages"
          ? "anthropic"
          : url.pathname === "/v1/responses"
            ? "openai"
            : url.pathname === "/v1/chat/completions"
              ? "chat"
              : undefined
      if (provider === undefined || req.method !== "POST") {
        res.writeHead(404, { "content-type": "application/json" })
        res.end(JSON.stringify({ error: { message: `no route ${req.method} ${url.pathname}` } }))
        return
      }
      const step = script.shift() ?? {
        kind: "error" as const,
        status: 500,
        message: "the mock's script is exhausted"
      }
      const serve = provider === "anthropic" ? anthropic : provider === "chat" ? chat : openai
      void serve(recorded, res, step).catch(() => res.destroy())
    })
  }
  const server =
    options.plain === true
      ? http.createServer({ keepAlive: true }, handler)
      : https.createServer(
          {
            cert: first.certPem,
            key: first.keyPem,
            keepAlive: true,
            SNICallback: (name, callback) => {
              const leaf = ca.leaf(name)
              callback(null, tls.createSecureContext({ cert: leaf.certPem, key: leaf.keyPem }))
            }
          },
          handler
        )
  let connections = 0
  server.on(options.plain === true ? "connection" : "secureConnection", () => connections++)
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", () => resolve()))
  const port = (server.address() as net.AddressInfo).port
  return {
    port,
    /** connections accepted so far (TLS ones, unless plain) */
    connections: () => connections,
    caPem: ca.certPem,
    requests,
    /** append steps to the script (each request takes the next) */
    push: (...steps: ReadonlyArray<MockStep>) => void script.push(...steps),
    /** steps not yet taken */
    pending: () => script.length,
    /** resolves once at least `n` requests have arrived */
    untilRequest: (n: number) =>
      new Promise<void>((resolve) => {
        if (requests.length >= n) resolve()
        else waiters.push({ n, resolve })
      }),
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections()
        server.close(() => resolve())
      })
  }
}

export type ModelMock = Awaited<ReturnType<typeof startModelMock>>
