/**
 * Prompt turns end to end over the fake backend (the real guest agent and model bundle as host
 * processes, the real broker): `ANTHROPIC_API_KEY=… abox run ./repo -p …` with no policy but a
 * `resolve` pin to the scripted mock. The key reaches the mock and nothing else; the guest's
 * tools see only the placeholder; context.json keeps the conversation and `abox resume -p`
 * carries it to the next request; `--model gpt` talks to the OpenAI API the same way.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { cliBundle, startCli, tempHome, withCliAndSource } from "./cliHelpers.js"
import { startModelMock, type ModelMock } from "./support/modelMock.js"

const sourceDir = withCliAndSource()
let mock: ModelMock
beforeAll(async () => {
  mock = await startModelMock()
})
afterAll(() => mock.close())

const CANARY = `sk-canary-${process.pid}-${Date.now()}`

const setUpHome = () => {
  const home = tempHome()
  const caFile = path.join(home, "mock-ca.pem")
  fs.writeFileSync(caFile, mock.caPem)
  fs.writeFileSync(
    path.join(home, "broker.json"),
    JSON.stringify({
      format: 1,
      allow: [],
      resolve: { "api.anthropic.com": `127.0.0.1:${mock.port}`, "api.openai.com": `127.0.0.1:${mock.port}` },
      upstreamCaFiles: [caFile]
    })
  )
  return home
}

/** the CLI as a child process, awaited without blocking this process (the mock answers from here) */
const abox = async (home: string, args: ReadonlyArray<string>, env: Record<string, string>) => {
  const cli = startCli(cliBundle, args, {
    PATH: process.env.PATH ?? "",
    HOME: path.join(home, "user"),
    ABOX_HOME: home,
    ABOX_VMM: "fake",
    ...env
  })
  const exit = await cli.exited
  return { code: exit.code, stdout: exit.stdout, stderr: exit.stderr }
}

const jsonEvents = (stdout: string) =>
  stdout
    .split("\n")
    .filter((line) => line.startsWith("{"))
    .map(
      (line) =>
        JSON.parse(line) as { event?: { _tag: string; event?: { kind: string } & Record<string, unknown> } }
    )
    .flatMap((line) =>
      line.event?._tag === "Event" && line.event.event !== undefined ? [line.event.event] : []
    )

/** every file under `dir`, read as text, that contains `needle` */
const filesContaining = (dir: string, needle: string): Array<string> =>
  fs.readdirSync(dir, { recursive: true, withFileTypes: true }).flatMap((entry) => {
    if (!entry.isFile()) return []
    const file = path.join(entry.parentPath, entry.name)
    return fs.readFileSync(file).includes(needle) ? [file] : []
  })

describe("prompt turns (fake backend, real broker)", () => {
  it("ANTHROPIC_API_KEY=… abox run -p: tools run, the key reaches only the mock, resume carries the conversation", async () => {
    const home = setUpHome()
    const repo = sourceDir()
    fs.writeFileSync(path.join(repo, "sum.js"), "module.exports = (a, b) => a - b\n")
    // relative paths only: the fake guest's repository lies under the 0700 session directory
    fs.writeFileSync(
      path.join(repo, "test.sh"),
      'grep -q "a + b" sum.js && echo PASS || { echo FAIL; exit 1; }\n'
    )
    mock.push(
      { kind: "tools", calls: [{ name: "read_file", input: { path: "sum.js" } }] },
      {
        kind: "tools",
        calls: [{ name: "edit_file", input: { path: "sum.js", old_string: "a - b", new_string: "a + b" } }]
      },
      {
        kind: "tools",
        calls: [{ name: "shell", input: { command: 'sh test.sh; echo "key=$ANTHROPIC_API_KEY"' } }]
      },
      { kind: "text", chunks: ["Fixed: ", "sum adds now."], usage: { input: 120, output: 30 } }
    )
    const before = mock.requests.length
    const run = await abox(home, ["run", repo, "--keep", "--json", "-p", "fix the failing test"], {
      ANTHROPIC_API_KEY: CANARY
    })
    expect(run.stderr).toBe("")
    expect(run.code).toBe(0)
    const events = jsonEvents(run.stdout)
    expect(events.filter((e) => e.kind === "tool_result").map((e) => [e.name, e.isError])).toEqual([
      ["read_file", false],
      ["edit_file", false],
      ["shell", false]
    ])
    const shell = events.find((e) => e.kind === "tool_result" && e.name === "shell")!
    expect(shell.output).toContain("PASS")
    expect(shell.output).toContain("key=abox-placeholder")
    expect(events.find((e) => e.kind === "usage")).toMatchObject({
      inputTokens: 150,
      outputTokens: 45,
      costUsd: 0.001125
    }) // four requests: 3 × (10, 5) + (120, 30)
    expect(events.at(-1)).toMatchObject({ kind: "agent_end", reason: "done", steps: 4 })

    const requests = mock.requests.slice(before)
    expect(requests).toHaveLength(4)
    expect(requests.map((r) => r.path)).toEqual(Array(4).fill("/v1/messages"))
    expect(requests.map((r) => r.headers["x-api-key"])).toEqual(Array(4).fill(CANARY))
    expect((requests[0]!.body as { model: string }).model).toBe("claude-sonnet-4-5")

    const id = fs.readdirSync(path.join(home, "sessions")).find((d) => !d.startsWith("."))!
    const sessionDir = path.join(home, "sessions", id)
    // the edit happened in the guest's copy, not the source
    expect(fs.readFileSync(path.join(sessionDir, "fake-guest", "repo", "sum.js"), "utf8")).toContain("a + b")
    expect(fs.readFileSync(path.join(repo, "sum.js"), "utf8")).toContain("a - b")
    const context = JSON.parse(
      fs.readFileSync(path.join(sessionDir, "fake-guest", "state", "context.json"), "utf8")
    ) as {
      format: number
      messages: Array<{ role: string }>
    }
    expect(context.format).toBe(2)
    expect(context.messages.map((m) => m.role)).toEqual([
      "user",
      "assistant",
      "tool",
      "assistant",
      "tool",
      "assistant",
      "tool",
      "assistant"
    ])
    const config = JSON.parse(fs.readFileSync(path.join(sessionDir, "guest-config.json"), "utf8")) as {
      model: string
      modelSpec: Record<string, unknown>
    }
    expect(config.modelSpec).toMatchObject({
      provider: "anthropic",
      id: "claude-sonnet-4-5",
      hostVariable: "ANTHROPIC_API_KEY"
    })
    // the key is nowhere in the session directory (guest disk, config, logs)
    expect(filesContaining(sessionDir, CANARY)).toEqual([])

    mock.push({ kind: "text", chunks: ["Yes."] })
    const resumed = await abox(home, ["resume", id, "--json", "-p", "are you sure?"], {
      ANTHROPIC_API_KEY: CANARY
    })
    expect(resumed.code).toBe(0)
    const carried = JSON.stringify(mock.requests.at(-1)!.body)
    expect(carried).toContain("fix the failing test")
    expect(carried).toContain("PASS")
    expect(carried).toContain("are you sure?")
    expect(filesContaining(sessionDir, CANARY)).toEqual([])
  })

  it("--model gpt speaks the OpenAI Responses API with OPENAI_API_KEY; a shell turn needs no key", async () => {
    const home = setUpHome()
    mock.push({ kind: "text", chunks: ["hello from gpt"] })
    const before = mock.requests.length
    const run = await abox(home, ["run", sourceDir(), "--model", "gpt", "-p", "say hello"], {
      OPENAI_API_KEY: CANARY
    })
    expect(run.code).toBe(0)
    expect(run.stdout).toContain("hello from gpt")
    const request = mock.requests[before]!
    expect(request.path).toBe("/v1/responses")
    expect(request.headers["authorization"]).toBe(`Bearer ${CANARY}`)

    const shell = await abox(home, ["run", sourceDir(), "--", "echo", "no key needed"], {})
    expect(shell.code).toBe(0)
    expect(shell.stdout).toBe("no key needed\n")

    // a prompt and a command at once is a usage error, before anything is made
    const both = await abox(home, ["run", sourceDir(), "-p", "hi", "--", "ls"], {})
    expect(both.code).toBe(64)
    expect(both.stderr).toContain("either --prompt or a shell command")
  })

  it("--max-steps and --max-cost end a prompt turn with the reason printed (exit 2); limits that cannot hold are refused", async () => {
    const home = setUpHome()
    const loop = { kind: "tools" as const, calls: [{ name: "shell", input: { command: "echo again" } }] }
    mock.push(loop)
    const before = mock.requests.length
    const stepped = await abox(home, ["run", sourceDir(), "--max-steps", "1", "-p", "loop"], {
      ANTHROPIC_API_KEY: CANARY
    })
    expect(stepped.code).toBe(2)
    expect(stepped.stderr).toContain(
      "abox: the agent stopped (max_steps): stopped after 1 model requests (max steps)"
    )
    expect(mock.requests.length - before).toBe(1)

    // sonnet's catalog prices: 100k in + 10k out at $3 / $15 per million = $0.45 a request
    const priced = { ...loop, usage: { input: 100_000, output: 10_000 } }
    mock.push(priced, priced)
    const costly = await abox(home, ["run", sourceDir(), "--json", "--max-cost", "0.5", "-p", "loop"], {
      ANTHROPIC_API_KEY: CANARY
    })
    expect(costly.code).toBe(2)
    expect(jsonEvents(costly.stdout).at(-1)).toEqual({
      kind: "agent_end",
      reason: "max_cost",
      steps: 2,
      message: "stopped after 2 model requests: spent $0.90 of the $0.50 limit (max cost)"
    })

    // a model the catalog has no prices for: a typed error before the turn, no request made
    fs.writeFileSync(
      path.join(home, "models.json"),
      JSON.stringify({ format: 1, models: { plain: { provider: "anthropic", id: "claude-plain" } } })
    )
    const requests = mock.requests.length
    const unpriced = await abox(
      home,
      ["run", sourceDir(), "--model", "plain", "--max-cost", "1", "-p", "hi"],
      {
        ANTHROPIC_API_KEY: CANARY
      }
    )
    expect(unpriced.code).toBe(64)
    expect(unpriced.stderr).toContain("--max-cost needs the model's prices")
    expect(unpriced.stderr).toContain("claude-plain")
    expect(mock.requests.length).toBe(requests)

    // the flags' own mistakes: usage errors before anything is made
    const shell = await abox(home, ["run", sourceDir(), "--max-steps", "2", "--", "true"], {})
    expect(shell.code).toBe(64)
    expect(shell.stderr).toContain("for a --prompt turn")
    const negative = await abox(home, ["run", sourceDir(), "--max-cost", "-1", "-p", "hi"], {})
    expect(negative.code).toBe(64)
    expect(negative.stderr).toContain("positive number")
  })

  it("a local model server (models.json api chat) on 127.0.0.1: refused without a policy entry, works through resolve with its own key variable", async () => {
    const home = tempHome()
    const caFile = path.join(home, "mock-ca.pem")
    fs.writeFileSync(caFile, mock.caPem)
    fs.writeFileSync(
      path.join(home, "models.json"),
      JSON.stringify({
        format: 1,
        models: {
          local: {
            provider: "openai",
            api: "chat",
            id: "qwen-local",
            endpoint: "https://llm.local:8443/v1",
            apiKeyEnv: null
          },
          // llama.cpp's and vLLM's --api-key: the broker terminates TLS and adds it, like a provider's
          localkey: {
            provider: "openai",
            api: "chat",
            id: "qwen-local",
            endpoint: "https://llm.local:8443/v1",
            apiKeyEnv: "LOCAL_LLM_KEY"
          }
        }
      })
    )
    const policy = (allow: ReadonlyArray<unknown>) =>
      fs.writeFileSync(
        path.join(home, "broker.json"),
        JSON.stringify({
          format: 1,
          allow,
          resolve: { "llm.local": `127.0.0.1:${mock.port}` },
          upstreamCaFiles: [caFile]
        })
      )
    // without the allow entry the broker refuses the local server, and the turn says so
    policy([])
    const before = mock.requests.length
    const refused = await abox(home, ["run", sourceDir(), "--model", "local", "--json", "-p", "hi"], {})
    expect(mock.requests.length).toBe(before)
    const end = jsonEvents(refused.stdout).find((e) => e.kind === "agent_end")
    expect(end).toMatchObject({ kind: "agent_end", reason: "error" })
    expect(String(end?.message)).toContain("llm.local")

    // with a key variable the entry's broker rule allows llm.local:8443 and adds the key; the
    // policy's resolve pins the name to the local server
    mock.push(
      { kind: "tools", text: "Listing.", calls: [{ name: "shell", input: { command: "echo from-tool" } }] },
      { kind: "text", chunks: ["local ", "answer"], usage: { input: 40, output: 8 } }
    )
    const run = await abox(home, ["run", sourceDir(), "--model", "localkey", "--json", "-p", "say hello"], {
      OPENAI_API_KEY: "sk-not-this-one",
      LOCAL_LLM_KEY: CANARY
    })
    expect(run.stderr).toBe("")
    expect(run.code).toBe(0)
    const events = jsonEvents(run.stdout)
    expect(events.filter((e) => e.kind === "tool_result").map((e) => [e.name, e.isError])).toEqual([
      ["shell", false]
    ])
    expect(
      events
        .filter((e) => e.kind === "text")
        .map((e) => e.delta)
        .join("")
    ).toBe("Listing.local answer")
    expect(events.at(-1)).toMatchObject({ kind: "agent_end", reason: "done", steps: 2 })
    const requests = mock.requests.slice(before)
    expect(requests.map((r) => r.path)).toEqual(["/v1/chat/completions", "/v1/chat/completions"])
    expect((requests[0]!.body as { model: string }).model).toBe("qwen-local")
    // the entry's own key variable, never OPENAI_API_KEY
    expect(requests.map((r) => r.headers["authorization"])).toEqual([`Bearer ${CANARY}`, `Bearer ${CANARY}`])
    // the tool's output went back as a tool message
    expect(JSON.stringify(requests[1]!.body)).toContain("from-tool")
  })

  it("a keyless model server over plain HTTP on the host's loopback (Ollama's http://127.0.0.1:11434/v1): the catalog entry alone opens that endpoint", async () => {
    const plain = await startModelMock({ plain: true })
    try {
      const home = tempHome()
      fs.writeFileSync(
        path.join(home, "models.json"),
        JSON.stringify({
          format: 1,
          models: {
            ollama: {
              provider: "openai",
              api: "chat",
              id: "qwen-local",
              endpoint: `http://127.0.0.1:${plain.port}/v1`,
              apiKeyEnv: null
            }
          }
        })
      )
      plain.push({ kind: "text", chunks: ["from ", "loopback"], usage: { input: 10, output: 2 } })
      const run = await abox(home, ["run", sourceDir(), "--model", "ollama", "--json", "-p", "say hello"], {})
      expect(run.stderr).toBe("")
      expect(run.code).toBe(0)
      const events = jsonEvents(run.stdout)
      expect(
        events
          .filter((e) => e.kind === "text")
          .map((e) => e.delta)
          .join("")
      ).toBe("from loopback")
      expect(events.at(-1)).toMatchObject({ kind: "agent_end", reason: "done", steps: 1 })
      expect(plain.requests.map((r) => [r.method, r.path])).toEqual([["POST", "/v1/chat/completions"]])
      // the server saw the Host a client on the host sends, and no placeholder key
      expect(plain.requests[0]!.headers["host"]).toBe(`127.0.0.1:${plain.port}`)
      expect(JSON.stringify(plain.requests[0]!.headers)).not.toContain("abox-placeholder")
      // the broker log names the mode
      const sessions = fs.readdirSync(path.join(home, "sessions"))
      const log = fs.readFileSync(path.join(home, "sessions", sessions[0]!, "broker.log"), "utf8")
      expect(log).toContain('"mode":"local-http"')
      expect(log).toContain(`"address":"127.0.0.1"`)
    } finally {
      await plain.close()
    }
  })
})

describe("prompt turns in a detached session (fake backend, real broker, real processes)", () => {
  it("abox exec -p runs a model turn in the running session; attach lines are prompts, !cmd a shell command", async () => {
    const home = setUpHome()
    const env = { ANTHROPIC_API_KEY: CANARY }
    const started = await abox(home, ["start", sourceDir(), "--name", "agentd"], env)
    expect(started.code).toBe(0)
    try {
      mock.push(
        { kind: "tools", calls: [{ name: "shell", input: { command: "echo tool-ran" } }] },
        { kind: "text", chunks: ["Done ", "over the socket."] }
      )
      const before = mock.requests.length
      const json = await abox(home, ["exec", "agentd", "--json", "-p", "run something"], {})
      expect(json.code).toBe(0)
      const events = jsonEvents(json.stdout)
      expect(events.find((e) => e.kind === "tool_result")).toMatchObject({ name: "shell", isError: false })
      expect(String(events.find((e) => e.kind === "tool_result")!.output)).toContain("tool-ran")
      expect(events.at(-1)).toMatchObject({ kind: "agent_end", reason: "done" })
      expect(mock.requests.length - before).toBe(2)
      // the supervisor's broker adds the key (the exec process has none)
      expect(mock.requests.at(-1)!.headers["x-api-key"]).toBe(CANARY)

      // rendered like run -p: the answer on stdout
      mock.push({ kind: "text", chunks: ["plain answer"] })
      const plain = await abox(home, ["exec", "agentd", "--prompt", "again"], {})
      expect(plain.code).toBe(0)
      expect(plain.stdout).toContain("plain answer")
      // the conversation is the session's: the second prompt carries the first
      expect(JSON.stringify(mock.requests.at(-1)!.body)).toContain("run something")

      // usage errors before any connection
      // the turn's own limit goes through the supervisor to the guest
      mock.push({ kind: "tools", calls: [{ name: "shell", input: { command: "echo again" } }] })
      const limited = await abox(home, ["exec", "agentd", "--max-steps", "1", "-p", "loop"], {})
      expect(limited.code).toBe(2)
      expect(limited.stderr).toContain("abox: the agent stopped (max_steps)")

      const both = await abox(home, ["exec", "agentd", "-p", "hi", "--", "ls"], {})
      expect(both.code).toBe(64)
      const withEnv = await abox(home, ["exec", "agentd", "-e", "A=1", "-p", "hi"], {})
      expect(withEnv.code).toBe(64)

      // attach: a line is a prompt, !cmd a shell command (as in abox open)
      mock.push({ kind: "text", chunks: ["attached answer"] })
      const attach = spawn(process.execPath, [cliBundle, "attach", "agentd"], {
        env: {
          PATH: process.env.PATH ?? "",
          HOME: path.join(home, "user"),
          ABOX_HOME: home,
          ABOX_VMM: "fake"
        },
        stdio: ["pipe", "pipe", "pipe"]
      })
      let out = ""
      let err = ""
      attach.stdout.on("data", (d: Buffer) => (out += d.toString()))
      attach.stderr.on("data", (d: Buffer) => (err += d.toString()))
      const exited = new Promise<number | null>((resolve) => attach.on("exit", (code) => resolve(code)))
      // one line at a time: the turns of one typist queue in order
      attach.stdin.write("!echo shell-$((40 + 2))\nwhat now?\n")
      attach.stdin.end()
      expect(await exited).toBe(0)
      expect(out).toContain("shell-42\n")
      expect(out).toContain("attached answer")
      expect(err).toContain("· turn 4: echo shell-$((40 + 2))")
      expect(err).toContain("· turn 5: what now?")
      expect(JSON.stringify(mock.requests.at(-1)!.body)).toContain("what now?")
    } finally {
      const stopped = await abox(home, ["stop", "agentd"], {})
      expect(stopped.code).toBe(0)
    }
  })
})
