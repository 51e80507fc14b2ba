/**
 * The model agent's loop against the scripted mock (direct HTTPS, no VM): streamed text, tool
 * calls run for real, results sent back, the conversation carried to the next request, errors
 * and retries as events, cancel mid-stream and mid-tool.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { createModelAgent, type ModelAgentOptions } from "../src/guest/model/index.js"
import type { ModelSpec } from "../src/protocol/GuestConfig.js"
import type { AgentEvent } from "../src/protocol/Messages.js"
import { alive } from "./support/processes.js"
import { startModelMock, type ModelMock } from "./support/modelMock.js"

let mock: ModelMock
beforeAll(async () => {
  mock = await startModelMock()
})
afterAll(() => mock.close())

const repo = () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-agent-loop-"))
  fs.writeFileSync(path.join(dir, "sum.js"), "module.exports = (a, b) => a - b\n")
  fs.writeFileSync(
    path.join(dir, "test.js"),
    "const sum = require('./sum.js')\nif (sum(2, 3) !== 5) { console.log('FAIL'); process.exit(1) }\nconsole.log('PASS')\n"
  )
  return dir
}

/** "chat": an OpenAI-compatible server's Chat Completions API (`api: "chat"`) */
type Flavor = ModelSpec["provider"] | "chat"

const spec = (flavor: Flavor): ModelSpec => {
  if (flavor === "chat") {
    return {
      provider: "openai",
      api: "chat",
      id: "local-test",
      endpoint: `https://localhost:${mock.port}/v1`
    }
  }
  return specOf(flavor)
}
const specOf = (provider: ModelSpec["provider"]): ModelSpec => ({
  provider,
  id: provider === "anthropic" ? "claude-test" : "gpt-test",
  endpoint: provider === "anthropic" ? `https://localhost:${mock.port}` : `https://localhost:${mock.port}/v1`,
  hostVariable: provider === "anthropic" ? "ANTHROPIC_API_KEY" : "OPENAI_API_KEY",
  inputPrice: 3,
  outputPrice: 15
})

const agentFor = (dir: string, provider: Flavor, extra: Partial<ModelAgentOptions> = {}) =>
  createModelAgent({
    spec: spec(provider),
    repoDir: dir,
    user: undefined,
    env: { PATH: process.env.PATH ?? "/usr/bin:/bin", HOME: dir, LANG: "C.UTF-8" },
    messages: [],
    caPems: [mock.caPem],
    log: () => undefined,
    ...extra
  })

const collect = () => {
  const events: Array<AgentEvent> = []
  return { events, sink: (event: AgentEvent) => void events.push(event) }
}

describe.each(["anthropic", "openai", "chat"] as const)("the agent loop (%s)", (provider) => {
  it("reads, edits, runs the test, answers; the next request carries the results", async () => {
    const dir = repo()
    const agent = agentFor(dir, provider)
    mock.push(
      { kind: "tools", text: "Looking.", calls: [{ name: "read_file", input: { path: "sum.js" } }] },
      {
        kind: "tools",
        calls: [{ name: "edit_file", input: { path: "sum.js", old_string: "a - b", new_string: "a + b" } }]
      },
      { kind: "tools", calls: [{ name: "shell", input: { command: "node test.js" } }] },
      { kind: "text", chunks: ["Fixed ", "the sum."], usage: { input: 100, output: 20 } }
    )
    const before = mock.requests.length
    const { events, sink } = collect()
    const outcome = await agent.run("fix the failing test", sink)
    expect(outcome).toEqual({ reason: "done", steps: 4 })
    expect(fs.readFileSync(path.join(dir, "sum.js"), "utf8")).toBe("module.exports = (a, b) => a + b\n")
    const kinds = events.map((e) => e.kind)
    expect(kinds.filter((k) => k === "tool_call")).toHaveLength(3)
    const results = events.filter((e) => e.kind === "tool_result")
    expect(results.map((r) => [r.name, r.isError])).toEqual([
      ["read_file", false],
      ["edit_file", false],
      ["shell", false]
    ])
    expect(results[2]!.output).toContain("PASS")
    expect(results[2]!.exitCode).toBe(0)
    expect(
      events
        .filter((e) => e.kind === "text")
        .map((e) => e.delta)
        .join("")
    ).toBe("Looking.Fixed the sum.")
    const usage = events.find((e) => e.kind === "usage")
    expect(usage).toMatchObject({ kind: "usage", model: spec(provider).id })
    expect(events.at(-1)).toEqual({ kind: "agent_end", reason: "done", steps: 4 })
    // the shell's output went back to the model in the fourth request
    const fourth = JSON.stringify(mock.requests[before + 3]!.body)
    expect(fourth).toContain("PASS")
    expect(fourth).toContain("fix the failing test")
    // the key the guest sends is the placeholder
    const header = provider === "anthropic" ? "x-api-key" : "authorization"
    expect(String(mock.requests[before]!.headers[header])).toContain("abox-placeholder")
    expect(mock.requests[before]!.path).toBe(
      provider === "anthropic"
        ? "/v1/messages"
        : provider === "openai"
          ? "/v1/responses"
          : "/v1/chat/completions"
    )

    // the conversation survives (context.json): a new agent from its messages carries it on
    const again = agentFor(dir, provider, { messages: agent.messages() })
    mock.push({ kind: "text", chunks: ["yes"] })
    await again.run("are you sure?", () => undefined)
    const carried = JSON.stringify(mock.requests.at(-1)!.body)
    expect(carried).toContain("fix the failing test")
    expect(carried).toContain("are you sure?")
    await agent.close()
    await again.close()
  })

  it("401 is an error naming the key variable; 429 and 529/5xx are retried visibly", async () => {
    const dir = repo()
    const agent = agentFor(dir, provider)
    mock.push({ kind: "error", status: 401, message: "invalid key" })
    const first = collect()
    const outcome = await agent.run("hi", first.sink)
    expect(outcome.reason).toBe("error")
    expect(outcome.message).toContain(spec(provider).hostVariable ?? "has no key (apiKeyEnv null)")
    expect(first.events.at(-1)).toMatchObject({ kind: "agent_end", reason: "error" })

    mock.push(
      { kind: "error", status: 429, retryAfter: 0 },
      { kind: "error", status: provider === "anthropic" ? 529 : 503, retryAfter: 0 },
      { kind: "text", chunks: ["ok"] }
    )
    const second = collect()
    expect((await agent.run("again", second.sink)).reason).toBe("done")
    expect(second.events.filter((e) => e.kind === "retry").map((e) => [e.attempt, e.reason])).toEqual([
      [1, "HTTP 429"],
      [2, `HTTP ${provider === "anthropic" ? 529 : 503}`]
    ])
    await agent.close()
  })

  it("a stream cut mid-answer ends the turn with an error", async () => {
    const agent = agentFor(repo(), provider)
    mock.push({ kind: "cut", chunks: ["par", "tial"] })
    const { events, sink } = collect()
    const outcome = await agent.run("hi", sink)
    expect(outcome.reason).toBe("error")
    expect(outcome.message).toContain("cut mid-answer")
    expect(events.filter((e) => e.kind === "retry")).toEqual([])
    await agent.close()
  })
})

describe("connections", () => {
  it("a streamed answer whose body ends after its last event keeps the connection for the next request", async () => {
    const agent = agentFor(repo(), "anthropic")
    const before = mock.connections()
    for (let i = 0; i < 4; i++) {
      // the body's end comes 50 ms after message_stop, as it may through the broker
      mock.push({ kind: "text", chunks: ["ok"], endDelayMs: 50 })
      expect((await agent.run("hi", () => undefined)).reason).toBe("done")
      // time for the body's end to arrive (without the drain the connection is dropped anyway)
      await new Promise((resolve) => setTimeout(resolve, 250))
    }
    // a request made while the last body still drains opens a second one; never one per request
    expect(mock.connections() - before).toBeLessThanOrEqual(2)
    await agent.close()
  })
})

describe("cancel", () => {
  it("mid-stream and mid-tool: the turn ends cancelled at once, nothing left running", async () => {
    const dir = repo()
    const agent = agentFor(dir, "anthropic")
    mock.push({ kind: "hang", chunks: ["thinking…"] })
    const first = collect()
    const n = mock.requests.length
    const running = agent.run("hi", first.sink)
    await mock.untilRequest(n + 1)
    while (!first.events.some((e) => e.kind === "text")) await new Promise((r) => setTimeout(r, 10))
    expect(agent.cancel()).toBe(true)
    expect((await running).reason).toBe("cancelled")

    const marker = `abox-cancel-${process.pid}-${Date.now()}`
    mock.push({
      kind: "tools",
      calls: [{ name: "shell", input: { command: `echo $$ > pid; exec sleep 300 # ${marker}` } }]
    })
    const second = collect()
    const tool = agent.run("sleep", second.sink)
    const pidFile = path.join(dir, "pid")
    while (!fs.existsSync(pidFile) || fs.readFileSync(pidFile, "utf8") === "")
      await new Promise((r) => setTimeout(r, 10))
    const pid = Number(fs.readFileSync(pidFile, "utf8"))
    expect(alive(pid)).toBe(true)
    expect(agent.cancel()).toBe(true)
    expect((await tool).reason).toBe("cancelled")
    for (let i = 0; i < 100 && alive(pid); i++) await new Promise((r) => setTimeout(r, 20))
    expect(alive(pid)).toBe(false)
    await agent.close()
  })
})
