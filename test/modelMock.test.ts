/**
 * The model mock is faithful: the official clients (`@anthropic-ai/sdk`, `openai`) parse every
 * scripted response — streamed text, tool calls, plain JSON answers and each error — as they
 * would the real APIs'.
 */
import Anthropic from "@anthropic-ai/sdk"
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import OpenAI from "openai"
import { Agent, fetch as undiciFetch } from "undici"
import { startModelMock, type ModelMock } from "./support/modelMock.js"

let mock: ModelMock
let dispatcher: Agent
const fetchVia = ((url: string, init?: RequestInit) =>
  undiciFetch(url, { ...(init as object), dispatcher } as never)) as unknown as typeof globalThis.fetch

beforeAll(async () => {
  mock = await startModelMock()
  dispatcher = new Agent({ connect: { ca: mock.caPem } })
})
afterAll(async () => {
  await dispatcher.close()
  await mock.close()
})

const anthropic = () =>
  new Anthropic({ apiKey: "k", baseURL: `https://localhost:${mock.port}`, fetch: fetchVia, maxRetries: 0 })
/** the text of a response's message items (a streamed final response has no `output_text`) */
const outputText = (response: OpenAI.Responses.Response): string =>
  response.output
    .flatMap((item) => (item.type === "message" ? item.content : []))
    .map((part) => (part.type === "output_text" ? part.text : ""))
    .join("")

const openai = () =>
  new OpenAI({ apiKey: "k", baseURL: `https://localhost:${mock.port}/v1`, fetch: fetchVia, maxRetries: 0 })

describe("Anthropic Messages API mock", () => {
  it("streamed text", async () => {
    mock.push({ kind: "text", chunks: ["Hel", "lo"], usage: { input: 7, output: 3 } })
    const stream = anthropic().messages.stream({
      model: "claude-x",
      max_tokens: 100,
      messages: [{ role: "user", content: "hi" }]
    })
    const deltas: Array<string> = []
    stream.on("text", (delta) => deltas.push(delta))
    const message = await stream.finalMessage()
    expect(deltas).toEqual(["Hel", "lo"])
    expect(message.content).toMatchObject([{ type: "text", text: "Hello" }])
    expect(message.stop_reason).toBe("end_turn")
    expect(message.usage.input_tokens).toBe(7)
    expect(message.usage.output_tokens).toBe(3)
    expect(mock.requests.at(-1)?.path).toBe("/v1/messages")
  })

  it("streamed tool calls", async () => {
    mock.push({
      kind: "tools",
      text: "Let me look.",
      calls: [
        { id: "toolu_a", name: "read_file", input: { path: "src/a.ts" } },
        { id: "toolu_b", name: "shell", input: { command: "ls -la" } }
      ]
    })
    const message = await anthropic()
      .messages.stream({ model: "claude-x", max_tokens: 100, messages: [{ role: "user", content: "hi" }] })
      .finalMessage()
    expect(message.stop_reason).toBe("tool_use")
    expect(message.content.map((block) => block.type)).toEqual(["text", "tool_use", "tool_use"])
    expect(message.content[1]).toMatchObject({
      id: "toolu_a",
      name: "read_file",
      input: { path: "src/a.ts" }
    })
    expect(message.content[2]).toMatchObject({ id: "toolu_b", name: "shell", input: { command: "ls -la" } })
  })

  it("plain JSON answers", async () => {
    mock.push({ kind: "tools", calls: [{ name: "list_files", input: {} }] })
    const message = await anthropic().messages.create({
      model: "claude-x",
      max_tokens: 100,
      messages: [{ role: "user", content: "hi" }]
    })
    expect(message.content[0]).toMatchObject({ type: "tool_use", name: "list_files", input: {} })
  })

  it.each([401, 429, 529, 500])("error %d", async (status) => {
    mock.push({ kind: "error", status, message: `nope ${status}` })
    const error = await anthropic()
      .messages.create({ model: "claude-x", max_tokens: 100, messages: [{ role: "user", content: "hi" }] })
      .then(
        () => undefined,
        (e: unknown) => e
      )
    expect(error).toBeInstanceOf(Anthropic.APIError)
    expect((error as InstanceType<typeof Anthropic.APIError>).status).toBe(status)
    expect(String((error as Error).message)).toContain(`nope ${status}`)
  })

  it("a cut stream is an error to the client", async () => {
    mock.push({ kind: "cut", chunks: ["par", "tial"] })
    const stream = anthropic().messages.stream({
      model: "claude-x",
      max_tokens: 100,
      messages: [{ role: "user", content: "hi" }]
    })
    const deltas: Array<string> = []
    stream.on("text", (delta) => deltas.push(delta))
    await expect(stream.finalMessage()).rejects.toThrow()
    expect(deltas.join("")).toBe("partial")
  })

  it("a slow stream arrives whole", async () => {
    mock.push({ kind: "text", chunks: ["a", "b", "c"], delayMs: 30 })
    const message = await anthropic()
      .messages.stream({ model: "claude-x", max_tokens: 100, messages: [{ role: "user", content: "hi" }] })
      .finalMessage()
    expect(message.content[0]).toMatchObject({ type: "text", text: "abc" })
  })
})

describe("OpenAI Responses API mock", () => {
  it("streamed text", async () => {
    mock.push({ kind: "text", chunks: ["Hel", "lo"], usage: { input: 7, output: 3 } })
    const stream = openai().responses.stream({ model: "gpt-x", input: "hi" })
    const deltas: Array<string> = []
    stream.on("response.output_text.delta", (event) => deltas.push(event.delta))
    const response = await stream.finalResponse()
    expect(deltas).toEqual(["Hel", "lo"])
    expect(outputText(response)).toBe("Hello")
    expect(response.usage?.input_tokens).toBe(7)
    expect(response.usage?.output_tokens).toBe(3)
    expect(mock.requests.at(-1)?.path).toBe("/v1/responses")
  })

  it("streamed tool calls", async () => {
    mock.push({
      kind: "tools",
      text: "Let me look.",
      calls: [
        { id: "call_a", name: "read_file", input: { path: "src/a.ts" } },
        { id: "call_b", name: "shell", input: { command: "ls" } }
      ]
    })
    const response = await openai().responses.stream({ model: "gpt-x", input: "hi" }).finalResponse()
    const calls = response.output.filter((item) => item.type === "function_call")
    expect(calls.map((call) => [call.call_id, call.name, JSON.parse(call.arguments)])).toEqual([
      ["call_a", "read_file", { path: "src/a.ts" }],
      ["call_b", "shell", { command: "ls" }]
    ])
    expect(outputText(response)).toBe("Let me look.")
  })

  it("plain JSON answers", async () => {
    mock.push({ kind: "text", chunks: ["done"] })
    const response = await openai().responses.create({ model: "gpt-x", input: "hi" })
    expect(response.output_text).toBe("done")
    expect(response.status).toBe("completed")
  })

  it.each([401, 429, 500, 503])("error %d", async (status) => {
    mock.push({ kind: "error", status, message: `nope ${status}` })
    const error = await openai()
      .responses.create({ model: "gpt-x", input: "hi" })
      .then(
        () => undefined,
        (e: unknown) => e
      )
    expect(error).toBeInstanceOf(OpenAI.APIError)
    expect((error as InstanceType<typeof OpenAI.APIError>).status).toBe(status)
    expect(String((error as Error).message)).toContain(`nope ${status}`)
  })

  it("a cut stream is an error to the client", async () => {
    mock.push({ kind: "cut", chunks: ["par", "tial"] })
    await expect(openai().responses.stream({ model: "gpt-x", input: "hi" }).finalResponse()).rejects.toThrow()
  })
})

describe("OpenAI Chat Completions API mock", () => {
  const messages = [{ role: "user" as const, content: "hi" }]

  it("streamed text", async () => {
    mock.push({ kind: "text", chunks: ["Hel", "lo"], usage: { input: 7, output: 3 } })
    const stream = openai().chat.completions.stream({
      model: "local-x",
      messages,
      stream_options: { include_usage: true }
    })
    const deltas: Array<string> = []
    stream.on("content", (delta) => deltas.push(delta))
    const completion = await stream.finalChatCompletion()
    expect(deltas).toEqual(["Hel", "lo"])
    expect(completion.choices[0]?.message.content).toBe("Hello")
    expect(completion.choices[0]?.finish_reason).toBe("stop")
    expect(completion.usage?.prompt_tokens).toBe(7)
    expect(completion.usage?.completion_tokens).toBe(3)
    expect(mock.requests.at(-1)?.path).toBe("/v1/chat/completions")
  })

  it("streamed tool calls (arguments in two deltas each)", async () => {
    mock.push({
      kind: "tools",
      text: "Let me look.",
      calls: [
        { id: "call_a", name: "read_file", input: { path: "src/a.ts" } },
        { id: "call_b", name: "bash", input: { command: "ls" } }
      ]
    })
    const completion = await openai()
      .chat.completions.stream({ model: "local-x", messages })
      .finalChatCompletion()
    const message = completion.choices[0]?.message
    expect(message?.content).toBe("Let me look.")
    expect(completion.choices[0]?.finish_reason).toBe("tool_calls")
    expect(
      (message?.tool_calls ?? []).map((call) =>
        call.type === "function" ? [call.id, call.function.name, JSON.parse(call.function.arguments)] : []
      )
    ).toEqual([
      ["call_a", "read_file", { path: "src/a.ts" }],
      ["call_b", "bash", { command: "ls" }]
    ])
  })

  it("plain JSON answers", async () => {
    mock.push({ kind: "text", chunks: ["done"] })
    const completion = await openai().chat.completions.create({ model: "local-x", messages })
    expect(completion.choices[0]?.message.content).toBe("done")
    expect(completion.object).toBe("chat.completion")
  })

  it.each([401, 429, 500, 503])("error %d", async (status) => {
    mock.push({ kind: "error", status, message: `nope ${status}` })
    const error = await openai()
      .chat.completions.create({ model: "local-x", messages })
      .then(
        () => undefined,
        (e: unknown) => e
      )
    expect(error).toBeInstanceOf(OpenAI.APIError)
    expect((error as InstanceType<typeof OpenAI.APIError>).status).toBe(status)
    expect(String((error as Error).message)).toContain(`nope ${status}`)
  })

  it("a cut stream is an error to the client", async () => {
    mock.push({ kind: "cut", chunks: ["par", "tial"] })
    await expect(
      openai().chat.completions.stream({ model: "local-x", messages }).finalChatCompletion()
    ).rejects.toThrow()
  })
})
