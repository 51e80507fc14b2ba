/**
 * The model agent's loop against the scripted mock (direct HTTPS, no VM): streamed text, tool
 * calls run for real, results sent back, the conversation carried to the next request, errors
 * and retries as events, cancel mid-stream and mid-tool.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import type { TunnelOpenResult } from "../src/guest/connectProxy.js"
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

const texts = (events: ReadonlyArray<AgentEvent>) =>
  events
    .filter((e) => e.kind === "status")
    .map((e) => e.message)
    .join("\n")

describe("the repository's instructions", () => {
  it("AGENTS.md and CLAUDE.md go into the system prompt, nearest the root first; .git and node_modules are skipped", async () => {
    const dir = repo()
    const put = (file: string, text: string) => {
      fs.mkdirSync(path.dirname(path.join(dir, file)), { recursive: true })
      fs.writeFileSync(path.join(dir, file), text)
    }
    put("sub/deep/CLAUDE.md", "DEEP-CLAUDE: deeper rules\n")
    put("CLAUDE.md", "ROOT-CLAUDE: use tabs\n")
    put("sub/AGENTS.md", "SUB-AGENTS: sub rules\n")
    put("AGENTS.md", "ROOT-AGENTS: run npm test\n")
    put(".git/AGENTS.md", "GIT-AGENTS\n")
    put("node_modules/pkg/AGENTS.md", "VENDORED-AGENTS\n")
    const agent = agentFor(dir, "anthropic")
    mock.push({ kind: "text", chunks: ["ok"] })
    expect((await agent.run("hi", () => undefined)).reason).toBe("done")
    const system = JSON.stringify((mock.requests.at(-1)!.body as { system?: unknown }).system)
    const order = ["ROOT-AGENTS", "ROOT-CLAUDE", "SUB-AGENTS", "DEEP-CLAUDE"].map((mark) =>
      system.indexOf(mark)
    )
    expect(order.every((at) => at > 0)).toBe(true)
    expect([...order].sort((a, b) => a - b)).toEqual(order)
    expect(system).toContain("## sub/deep/CLAUDE.md")
    expect(system).not.toContain("GIT-AGENTS")
    expect(system).not.toContain("VENDORED-AGENTS")
    // read afresh each turn: an edit counts from the next one
    fs.writeFileSync(path.join(dir, "AGENTS.md"), "ROOT-AGENTS-EDITED\n")
    mock.push({ kind: "text", chunks: ["ok"] })
    await agent.run("again", () => undefined)
    expect(JSON.stringify((mock.requests.at(-1)!.body as { system?: unknown }).system)).toContain(
      "ROOT-AGENTS-EDITED"
    )
    await agent.close()
  })

  it("are capped: the nearest kept, the cut said, the rest named but not sent", async () => {
    const dir = repo()
    fs.writeFileSync(path.join(dir, "AGENTS.md"), "NEAR " + "a".repeat(40 * 1024) + " NEAR-END\n")
    fs.mkdirSync(path.join(dir, "sub"))
    fs.writeFileSync(path.join(dir, "sub", "CLAUDE.md"), "FAR-CLAUDE\n")
    const agent = agentFor(dir, "anthropic")
    mock.push({ kind: "text", chunks: ["ok"] })
    await agent.run("hi", () => undefined)
    const system = JSON.stringify((mock.requests.at(-1)!.body as { system?: unknown }).system)
    expect(system).toContain("NEAR a")
    expect(system).not.toContain("NEAR-END")
    expect(system).toContain("AGENTS.md cut: instructions are capped at 32768 characters")
    expect(system).toContain("not included: sub/CLAUDE.md")
    expect(system).not.toContain("FAR-CLAUDE")
    expect(system.length).toBeLessThan(32 * 1024 + 4000)
    await agent.close()
  })

  it("a repository without them gets the plain system prompt", async () => {
    const agent = agentFor(repo(), "anthropic")
    mock.push({ kind: "text", chunks: ["ok"] })
    await agent.run("hi", () => undefined)
    expect(JSON.stringify((mock.requests.at(-1)!.body as { system?: unknown }).system)).not.toContain(
      "Repository instructions"
    )
    await agent.close()
  })
})

describe.each(["anthropic", "openai", "chat"] as const)("turn limits (%s)", (provider) => {
  const loop = (n: number) =>
    Array.from({ length: n }, () => ({
      kind: "tools" as const,
      calls: [{ name: "shell", input: { command: "echo step" } }],
      usage: { input: 100_000, output: 10_000 }
    }))

  it("max steps: the turn's own limit ends it after that many requests, with the reason", async () => {
    const agent = agentFor(repo(), provider, { maxSteps: 50 })
    // exactly what the limit lets through: a third request would find the script empty
    mock.push(...loop(2))
    const before = mock.requests.length
    const { events, sink } = collect()
    const outcome = await agent.run("loop", sink, { maxSteps: 2 })
    expect(outcome).toEqual({
      reason: "max_steps",
      steps: 2,
      message: "stopped after 2 model requests (max steps)"
    })
    expect(mock.requests.length - before).toBe(2)
    expect(events.at(-1)).toEqual({ kind: "agent_end", ...outcome })
    await agent.close()
  })

  it("max cost: the turn ends once its cost (usage × prices) reaches the limit, with the reason", async () => {
    const agent = agentFor(repo(), provider, { spec: { ...spec(provider), inputPrice: 3, outputPrice: 15 } })
    // each step: 100k in × $3/M + 10k out × $15/M = $0.45
    mock.push(...loop(2))
    const before = mock.requests.length
    const { events, sink } = collect()
    const outcome = await agent.run("loop", sink, { maxCostUsd: 0.8 })
    expect(outcome).toEqual({
      reason: "max_cost",
      steps: 2,
      message: "stopped after 2 model requests: spent $0.90 of the $0.80 limit (max cost)"
    })
    expect(mock.requests.length - before).toBe(2)
    expect(events.find((e) => e.kind === "usage")).toMatchObject({
      inputTokens: 200_000,
      outputTokens: 20_000,
      costUsd: 0.9
    })
    expect(events.at(-1)).toEqual({ kind: "agent_end", ...outcome })
    await agent.close()
  })

  it("max cost on a model without prices is an error before any request", async () => {
    const { inputPrice: _i, outputPrice: _o, ...unpriced } = spec(provider)
    const agent = agentFor(repo(), provider, { spec: unpriced })
    const before = mock.requests.length
    const outcome = await agent.run("loop", () => undefined, { maxCostUsd: 1 })
    expect(outcome.reason).toBe("error")
    expect(outcome.message).toContain("needs the model's prices")
    expect(outcome.message).toContain("inputPrice and outputPrice")
    expect(mock.requests.length).toBe(before)
    // the refused request is not in the conversation
    expect(JSON.stringify(agent.messages())).not.toContain("loop")
    await agent.close()
  })
})

describe("context after every step", () => {
  it("each finished step is handed over at once; a turn cancelled mid-step keeps the ones before", async () => {
    const dir = repo()
    const saved: Array<string> = []
    const agent = agentFor(dir, "anthropic", {
      onStep: async (messages) => {
        saved.push(JSON.stringify(messages))
      }
    })
    mock.push(
      { kind: "tools", calls: [{ name: "shell", input: { command: "echo FIRST-STEP-OUTPUT" } }] },
      { kind: "hang", chunks: ["still thinking"] }
    )
    const n = mock.requests.length
    const running = agent.run("two steps", () => undefined)
    await mock.untilRequest(n + 2)
    // the first step (its tool result) was saved before the second request went out
    expect(saved).toHaveLength(1)
    expect(saved[0]).toContain("FIRST-STEP-OUTPUT")
    expect(saved[0]).toContain("two steps")
    expect(agent.cancel()).toBe(true)
    expect((await running).reason).toBe("cancelled")
    expect(JSON.stringify(agent.messages())).toContain("FIRST-STEP-OUTPUT")
    await agent.close()
  })
})

describe("a step's save and the next request", () => {
  it("the next request leaves only once the finished step is saved; the turn ends after its last save", async () => {
    let release: () => void = () => undefined
    const gate = new Promise<void>((resolve) => (release = resolve))
    const saved: Array<string> = []
    let calls = 0
    const agent = agentFor(repo(), "anthropic", {
      onStep: async (messages) => {
        calls++
        await gate
        saved.push(JSON.stringify(messages))
      }
    })
    mock.push(
      { kind: "tools", calls: [{ name: "shell", input: { command: "echo SAVED-STEP" } }] },
      { kind: "text", chunks: ["done"] }
    )
    const n = mock.requests.length
    let ended = false
    const running = agent.run("save first", () => undefined).then((outcome) => {
      ended = true
      return outcome
    })
    while (calls < 1) await new Promise((resolve) => setTimeout(resolve, 5))
    await new Promise((resolve) => setTimeout(resolve, 300))
    // the first step's save still waits: no second request, no end
    expect(mock.requests.length - n).toBe(1)
    expect(ended).toBe(false)
    release()
    expect((await running).reason).toBe("done")
    expect(mock.requests.length - n).toBe(2)
    expect(saved).toHaveLength(2)
    expect(saved[0]).toContain("SAVED-STEP")
    expect(saved[1]).toContain("done")
    await agent.close()
  })
})

describe("model connections through the agent's own tunnel", () => {
  const tunnelTo = (calls: Array<string>) => (host: string, port: number) => {
    calls.push(`${host}:${port}`)
    return new Promise<TunnelOpenResult>((resolve, reject) => {
      const socket = net.connect({ host: "127.0.0.1", port: mock.port })
      socket.once("connect", () => resolve({ ok: true, stream: socket }))
      socket.once("error", reject)
    })
  }

  it("each connection is a tunnel asked for the model's host and port (no proxy socket)", async () => {
    const calls: Array<string> = []
    const agent = agentFor(repo(), "anthropic", { openTunnel: tunnelTo(calls) })
    mock.push(
      { kind: "tools", calls: [{ name: "shell", input: { command: "echo THROUGH-TUNNEL" } }] },
      { kind: "text", chunks: ["done"] }
    )
    const n = mock.requests.length
    expect((await agent.run("tunnel", () => undefined)).reason).toBe("done")
    expect(mock.requests.length - n).toBe(2)
    expect(JSON.stringify(mock.requests[n + 1]!.body)).toContain("THROUGH-TUNNEL")
    // one tunnel, kept for the second request
    expect(calls).toEqual([`localhost:${mock.port}`])
    await agent.close()
  })

  it("a tunnel the broker refuses ends the turn with its reason", async () => {
    const agent = agentFor(repo(), "anthropic", {
      openTunnel: () => Promise.resolve({ ok: false, reason: "host-not-allowed: TUNNEL-REFUSED" })
    })
    const n = mock.requests.length
    const outcome = await agent.run("refused", () => undefined)
    expect(outcome.reason).toBe("error")
    expect(outcome.message).toContain(
      `the broker refused the connection to the model: localhost:${mock.port}: host-not-allowed: TUNNEL-REFUSED`
    )
    expect(mock.requests.length).toBe(n)
    await agent.close()
  })
})

describe.each(["anthropic", "openai", "chat"] as const)("compaction (%s)", (provider) => {
  // a small window: two 5000-character tool outputs pass the 75 % mark
  const small = (): ModelSpec => ({ ...spec(provider), contextWindow: 3000 })
  const big = (mark: string) => ({
    kind: "tools" as const,
    calls: [
      { name: "shell", input: { command: `printf '${mark}-%s' OUTPUT; head -c 5000 /dev/zero | tr '\\0' x` } }
    ]
  })

  it("asks the model for a summary, which replaces the earlier exchanges", async () => {
    const agent = agentFor(repo(), provider, { spec: small() })
    mock.push(big("OLD"), { kind: "text", chunks: ["first done"] })
    expect((await agent.run("TURN-ONE-REQUEST", () => undefined)).reason).toBe("done")
    mock.push(
      big("NEW"),
      { kind: "text", chunks: ["SUMMARY-OF-TURN-ONE"], usage: { input: 7, output: 3 } },
      { kind: "text", chunks: ["second done"] }
    )
    const n = mock.requests.length
    const { events, sink } = collect()
    expect((await agent.run("TURN-TWO-REQUEST", sink)).reason).toBe("done")
    expect(mock.requests.length - n).toBe(3)
    const summaryRequest = JSON.stringify(mock.requests[n + 1]!.body)
    expect(summaryRequest).toContain("only your summary of it will remain")
    expect(summaryRequest).toContain("TURN-ONE-REQUEST")
    expect(summaryRequest).toContain("OLD-OUTPUT")
    // the current exchange is kept, not summarised
    expect(summaryRequest).not.toContain("TURN-TWO-REQUEST")
    const next = JSON.stringify(mock.requests[n + 2]!.body)
    expect(next).toContain("SUMMARY-OF-TURN-ONE")
    expect(next).toContain("TURN-TWO-REQUEST")
    expect(next).toContain("NEW-OUTPUT")
    expect(next).not.toContain("OLD-OUTPUT")
    expect(next).not.toContain("TURN-ONE-REQUEST")
    expect(texts(events)).toContain("the model summarised the 4 earlier messages")
    // the summary's tokens are counted
    const usage = events.find((e) => e.kind === "usage")
    expect(usage?.kind === "usage" && usage.inputTokens).toBeGreaterThanOrEqual(7)
    // the conversation kept is the compacted one
    expect(JSON.stringify(agent.messages())).toContain("SUMMARY-OF-TURN-ONE")
    await agent.close()
  })

  it("falls back to trimming when the summary request fails", async () => {
    const agent = agentFor(repo(), provider, { spec: small() })
    mock.push(big("OLD"), { kind: "text", chunks: ["first done"] })
    await agent.run("TURN-ONE-REQUEST", () => undefined)
    mock.push(
      big("NEW"),
      { kind: "error", status: 400, message: "bad summary" },
      { kind: "text", chunks: ["ok"] }
    )
    const n = mock.requests.length
    const { events, sink } = collect()
    expect((await agent.run("TURN-TWO-REQUEST", sink)).reason).toBe("done")
    expect(mock.requests.length - n).toBe(3)
    const next = JSON.stringify(mock.requests[n + 2]!.body)
    expect(next).not.toContain("OLD-OUTPUT")
    expect(next).toContain("NEW-OUTPUT")
    // the deterministic summary of what was dropped opens the kept exchange
    expect(next).toContain("dropped to fit the context window")
    expect(texts(events)).toContain("the summary for compaction failed")
    expect(texts(events)).toContain("dropped the 4 oldest messages")
    await agent.close()
  })
})
