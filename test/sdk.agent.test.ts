/**
 * The SDK's prompt turns over the fake backend and the real broker: `run(text, { mode: "prompt" })`
 * gives the answer, the typed agent events and why the agent stopped; the key comes from the
 * host's environment (the catalog's provider rule), the policy only pins the name to the mock.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import type { ToolResultEvent } from "../src/sdk/index.js"
import { startModelMock, type ModelMock } from "./support/modelMock.js"

const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-sdk-agent-"))
const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-sdk-agent-src-"))
process.env.ABOX_HOME = home
process.env.ABOX_VMM = "fake"
const canary = `sk-ant-sdk-canary-${process.pid}`
process.env.ANTHROPIC_API_KEY = canary

const sdk = await import("../src/sdk/index.js")
let mock: ModelMock

beforeAll(async () => {
  mock = await startModelMock()
  fs.writeFileSync(path.join(source, "hello.txt"), "hello\n")
  fs.writeFileSync(path.join(home, "mock-ca.pem"), mock.caPem)
})
afterAll(async () => {
  await sdk.dispose()
  await mock.close()
  fs.rmSync(home, { recursive: true, force: true })
  fs.rmSync(source, { recursive: true, force: true })
})

describe("SDK prompt turns", () => {
  it("run(text, { mode: 'prompt' }): the answer, typed tool events, the end; a shell turn alongside", async () => {
    await using session = await sdk.open({
      source,
      policy: {
        format: 1,
        allow: [],
        credentials: [],
        resolve: { "api.anthropic.com": `127.0.0.1:${mock.port}` },
        upstreamCaFiles: [path.join(home, "mock-ca.pem")]
      }
    })
    mock.push(
      { kind: "tools", calls: [{ name: "read_file", input: { path: "hello.txt" } }] },
      { kind: "text", chunks: ["It says ", "hello."] }
    )
    const outcome = await session.run("what does hello.txt say?", { mode: "prompt" })
    expect(outcome.exitCode).toBe(0)
    expect(outcome.answer).toBe("It says hello.")
    expect(outcome.agentEnd).toEqual({ kind: "agent_end", reason: "done", steps: 2 })
    const results: Array<ToolResultEvent> = outcome.events.flatMap((e) =>
      e._tag === "Event" && e.event.kind === "tool_result" ? [e.event] : []
    )
    expect(results.map((r) => [r.name, r.output])).toEqual([["read_file", "1\thello"]])
    expect(mock.requests.at(-1)?.headers["x-api-key"]).toBe(canary)
    expect((await session.run("cat hello.txt")).stdout).toBe("hello\n")

    // a turn's own limits: the end says which one stopped it
    const loop = { kind: "tools" as const, calls: [{ name: "shell", input: { command: "echo again" } }] }
    mock.push(loop)
    const stepped = await session.run("loop", { mode: "prompt", maxSteps: 1 })
    expect(stepped.exitCode).toBe(2)
    expect(stepped.agentEnd).toEqual({
      kind: "agent_end",
      reason: "max_steps",
      steps: 1,
      message: "stopped after 1 model requests (max steps)"
    })
    // sonnet's catalog prices ($3 / $15 per million): 100k in + 10k out = $0.45 a request
    mock.push(
      { ...loop, usage: { input: 100_000, output: 10_000 } },
      { ...loop, usage: { input: 100_000, output: 10_000 } }
    )
    const costly = await session.run("loop", { mode: "prompt", maxCostUsd: 0.5 })
    expect(costly.exitCode).toBe(2)
    expect(costly.agentEnd).toMatchObject({ reason: "max_cost", steps: 2 })
    expect(costly.agentEnd?.message).toContain("spent $0.90 of the $0.50 limit")
    // limits for a shell turn, or out of range: the turn ends at once with why, nothing sent
    const before = mock.requests.length
    const shell = await session.run("echo hi", { maxSteps: 3 })
    expect(shell.exitCode).toBe(1)
    expect(shell.agentEnd?.message).toContain("for prompt turns")
    const zero = await session.run("loop", { mode: "prompt", maxSteps: 0 })
    expect(zero.agentEnd).toMatchObject({ reason: "error" })
    expect(zero.agentEnd?.message).toContain("from 1 to 1000")
    expect(mock.requests.length).toBe(before)
  })
})
