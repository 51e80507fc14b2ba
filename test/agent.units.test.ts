/**
 * The model agent's parts without a model server: tool caps and refusals, process-group kill on
 * timeout, retries with backoff under TestClock (a scripted LanguageModel), compaction, and the
 * terminal rendering of every agent event.
 */
import * as LanguageModel from "@effect/ai/LanguageModel"
import * as AiError from "@effect/ai/AiError"
import * as Prompt from "@effect/ai/Prompt"
import * as Response from "@effect/ai/Response"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import * as TestClock from "effect/TestClock"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { agentRenderer } from "../src/cli/agentOutput.js"
import { compact, estimateTokens, promptTurn, SUMMARY_MARK, summaryOf } from "../src/guest/model/loop.js"
import { pathsSeen } from "../src/guest/model/fileText.js"
import {
  instructionsSection,
  INSTRUCTIONS_MAX_FILES,
  readInstructions
} from "../src/guest/model/instructions.js"
import { AgentToolkit, capText, makeHandlers, resolveRepoPath } from "../src/guest/model/tools.js"
import type { ModelSpec } from "../src/protocol/GuestConfig.js"
import type { AgentEvent } from "../src/protocol/Messages.js"
import { alive } from "./support/processes.js"

const repo = () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-agent-units-"))
  fs.writeFileSync(path.join(dir, "a.txt"), "one\ntwo\nthree\nfour\n")
  return dir
}
const handlersFor = (dir: string, outputCap?: number) =>
  makeHandlers({
    repoDir: dir,
    user: undefined,
    env: { PATH: process.env.PATH ?? "/usr/bin:/bin", HOME: dir },
    ...(outputCap === undefined ? {} : { outputCap })
  })

describe("tools", () => {
  it("output is capped with head and tail kept and the cut said", () => {
    const text = "H".repeat(100) + "M".repeat(1000) + "T".repeat(100)
    const { output, truncated } = capText(text, 200)
    expect(truncated).toBe(true)
    expect(output.startsWith("H".repeat(100))).toBe(true)
    expect(output.endsWith("T".repeat(100))).toBe(true)
    expect(output).toContain("1000 characters cut")
    expect(capText("short", 200)).toEqual({ output: "short", truncated: false })
  })

  it.live("shell output over the cap keeps head and tail", () =>
    Effect.gen(function* () {
      const handlers = handlersFor(repo(), 1000)
      const result = yield* handlers.shell({ command: "echo BEGIN; seq 1 20000; echo END" })
      expect(result.truncated).toBe(true)
      expect(result.output.startsWith("BEGIN\n1\n")).toBe(true)
      expect(result.output.trimEnd().endsWith("END")).toBe(true)
      expect(result.exitCode).toBe(0)
    })
  )

  it("paths outside the repository are refused, symlinks out included", () => {
    const dir = repo()
    fs.symlinkSync("/etc", path.join(dir, "etc-link"))
    expect(resolveRepoPath(dir, "a.txt")).toEqual({ ok: true, path: path.join(dir, "a.txt") })
    expect(resolveRepoPath(dir, "/work/repo/a.txt")).toEqual({ ok: true, path: path.join(dir, "a.txt") })
    expect(resolveRepoPath(dir, "new/dir/file.txt").ok).toBe(true)
    for (const bad of ["../x", "/etc/passwd", "etc-link/passwd", "etc-link", "/work/repo/../x"]) {
      expect(resolveRepoPath(dir, bad).ok, bad).toBe(false)
    }
  })

  it.live("read_file numbers its lines and takes a range; a range past the end is an error", () =>
    Effect.gen(function* () {
      const dir = repo()
      const h = handlersFor(dir)
      expect((yield* h.read_file({ path: "a.txt" })).output).toBe("1\tone\n2\ttwo\n3\tthree\n4\tfour")
      // a range within: the rest is announced with where to read on
      expect((yield* h.read_file({ path: "a.txt", offset: 2, limit: 2 })).output).toBe(
        "2\ttwo\n3\tthree\n[lines 2-3 of 4; read on with offset 4]"
      )
      // the last line, and a limit past the end: no note
      expect((yield* h.read_file({ path: "a.txt", offset: 4, limit: 10 })).output).toBe("4\tfour")
      // past the end: an error naming the file's length, not an empty success
      const past = yield* h.read_file({ path: "a.txt", offset: 5 })
      expect(past).toMatchObject({ isError: true, exitCode: null })
      expect(past.output).toBe("a.txt: offset 5 is past the end of the file (4 lines)")
      // numbers are right-aligned to the widest shown; a file without a final newline keeps its last line
      fs.writeFileSync(
        path.join(dir, "ten.txt"),
        Array.from({ length: 12 }, (_, i) => `l${i + 1}`).join("\n")
      )
      expect((yield* h.read_file({ path: "ten.txt", offset: 9, limit: 4 })).output).toBe(
        " 9\tl9\n10\tl10\n11\tl11\n12\tl12"
      )
      fs.writeFileSync(path.join(dir, "empty.txt"), "")
      expect((yield* h.read_file({ path: "empty.txt" })).output).toBe("(empty file)")
      expect((yield* h.read_file({ path: "empty.txt", offset: 2 })).isError).toBe(true)
    })
  )

  it.live("edit_file: one match replaced; several refused unless replace_all; none is an error", () =>
    Effect.gen(function* () {
      const dir = repo()
      const h = handlersFor(dir)
      fs.writeFileSync(path.join(dir, "c.txt"), "x = 1\ny = x + x\n")
      yield* h.read_file({ path: "c.txt" })
      // many, without replace_all: refused with the count, the file untouched
      const many = yield* h.edit_file({ path: "c.txt", old_string: "x", new_string: "z" })
      expect(many.isError).toBe(true)
      expect(many.output).toContain("occurs 3 times")
      expect(fs.readFileSync(path.join(dir, "c.txt"), "utf8")).toBe("x = 1\ny = x + x\n")
      // many, with replace_all: every one replaced, the count said
      const all = yield* h.edit_file({ path: "c.txt", old_string: "x", new_string: "z", replace_all: true })
      expect(all).toMatchObject({ isError: false, output: "edited c.txt (3 occurrences replaced)" })
      expect(fs.readFileSync(path.join(dir, "c.txt"), "utf8")).toBe("z = 1\ny = z + z\n")
      // one, with and without replace_all
      expect((yield* h.edit_file({ path: "c.txt", old_string: "y =", new_string: "w =" })).output).toBe(
        "edited c.txt"
      )
      expect(
        (yield* h.edit_file({ path: "c.txt", old_string: "= 1", new_string: "= 2", replace_all: true }))
          .output
      ).toBe("edited c.txt")
      expect(fs.readFileSync(path.join(dir, "c.txt"), "utf8")).toBe("z = 2\nw = z + z\n")
      // none, with and without replace_all: an error, nothing written
      for (const replace_all of [false, true]) {
        const none = yield* h.edit_file({ path: "c.txt", old_string: "q", new_string: "r", replace_all })
        expect(none.isError).toBe(true)
        expect(none.output).toContain("not found")
      }
      // `$&` in the replacement is text, not a pattern
      yield* h.edit_file({ path: "c.txt", old_string: "w", new_string: "$&$1", replace_all: true })
      expect(fs.readFileSync(path.join(dir, "c.txt"), "utf8")).toBe("z = 2\n$&$1 = z + z\n")
    })
  )

  it.live(
    "edit_file refuses a file not read in this conversation; a read, a write or a restored read allows it",
    () =>
      Effect.gen(function* () {
        const dir = repo()
        const h = handlersFor(dir)
        const refused = yield* h.edit_file({ path: "a.txt", old_string: "one", new_string: "1" })
        expect(refused).toMatchObject({
          isError: true,
          output: "refused: read a.txt with read_file before editing it"
        })
        expect(fs.readFileSync(path.join(dir, "a.txt"), "utf8")).toBe("one\ntwo\nthree\nfour\n")
        // a failed read (past the end) does not count
        yield* h.read_file({ path: "a.txt", offset: 99 })
        expect((yield* h.edit_file({ path: "a.txt", old_string: "one", new_string: "1" })).isError).toBe(true)
        // the same file under another spelling is the same file
        yield* h.read_file({ path: "/work/repo/./a.txt", limit: 1 })
        expect((yield* h.edit_file({ path: "a.txt", old_string: "one", new_string: "1" })).isError).toBe(
          false
        )
        // a file the model wrote itself
        yield* h.write_file({ path: "new.txt", content: "n\n" })
        expect((yield* h.edit_file({ path: "new.txt", old_string: "n", new_string: "m" })).isError).toBe(
          false
        )

        // a conversation restored from context.json: its successful reads and writes count
        const messages = [
          { role: "user", content: "go" },
          {
            role: "assistant",
            content: [
              {
                type: "tool-call",
                id: "r1",
                name: "read_file",
                params: { path: "a.txt" },
                providerExecuted: false
              },
              {
                type: "tool-call",
                id: "r2",
                name: "read_file",
                params: { path: "b.txt" },
                providerExecuted: false
              }
            ]
          },
          {
            role: "tool",
            content: [
              {
                type: "tool-result",
                id: "r1",
                name: "read_file",
                result: { output: "1\tone", isError: false },
                isFailure: false
              },
              {
                type: "tool-result",
                id: "r2",
                name: "read_file",
                result: { output: "no such file", isError: true },
                isFailure: false
              }
            ]
          }
        ]
        expect(pathsSeen(messages)).toEqual(["a.txt"])
      })
  )

  it.live("edit_file refuses a replace_all whose result would pass the bound (the agent's memory)", () =>
    Effect.gen(function* () {
      const dir = repo()
      const h = handlersFor(dir)
      fs.writeFileSync(path.join(dir, "many.txt"), "a".repeat(1000))
      yield* h.read_file({ path: "many.txt" })
      const huge = yield* h.edit_file({
        path: "many.txt",
        old_string: "a",
        new_string: "x".repeat(20_000),
        replace_all: true
      })
      expect(huge.isError).toBe(true)
      expect(huge.output).toContain("would be 20000000 characters")
      expect(fs.readFileSync(path.join(dir, "many.txt"), "utf8")).toBe("a".repeat(1000))
    })
  )

  it.live("write_file, edit_file must match once, refusals are errors", () =>
    Effect.gen(function* () {
      const dir = repo()
      const h = handlersFor(dir)
      expect((yield* h.write_file({ path: "sub/b.txt", content: "x x\n" })).isError).toBe(false)
      expect(fs.readFileSync(path.join(dir, "sub/b.txt"), "utf8")).toBe("x x\n")
      const twice = yield* h.edit_file({ path: "sub/b.txt", old_string: "x", new_string: "y" })
      expect(twice.isError).toBe(true)
      expect(twice.output).toContain("occurs 2 times")
      const none = yield* h.edit_file({ path: "sub/b.txt", old_string: "z", new_string: "y" })
      expect(none.output).toContain("not found")
      expect((yield* h.edit_file({ path: "sub/b.txt", old_string: "x x", new_string: "y" })).isError).toBe(
        false
      )
      expect(fs.readFileSync(path.join(dir, "sub/b.txt"), "utf8")).toBe("y\n")
      const refused = yield* h.read_file({ path: "/etc/passwd" })
      expect(refused).toMatchObject({ isError: true, exitCode: null })
      expect(refused.output).toContain("outside the repository")
      expect((yield* h.write_file({ path: "../escape.txt", content: "no" })).isError).toBe(true)
      expect(fs.existsSync(path.join(dir, "..", "escape.txt"))).toBe(false)
      expect((yield* h.search({ pattern: "thr+ee" })).output).toContain("a.txt:3:three")
      const none2 = yield* h.search({ pattern: "absent-pattern" })
      expect(none2.isError).toBe(false)
      expect((yield* h.list_files({})).output).toContain("a.txt")
    })
  )

  it.live("a timed-out command's whole process group is killed", () =>
    Effect.gen(function* () {
      const dir = repo()
      const h = handlersFor(dir)
      const result = yield* h.shell({ command: "(sleep 300 & echo $! > bg.pid; wait)", timeout_seconds: 1 })
      expect(result.isError).toBe(true)
      expect(result.output).toContain("timed out")
      const pid = Number(fs.readFileSync(path.join(dir, "bg.pid"), "utf8"))
      for (let i = 0; i < 50 && alive(pid); i++) yield* Effect.sleep("20 millis")
      expect(alive(pid)).toBe(false)
    })
  )
})

describe("instructions", () => {
  const env = { PATH: process.env.PATH ?? "/usr/bin:/bin", HOME: os.tmpdir() }
  it.live(
    "a symlink, a FIFO or a directory named AGENTS.md is not followed; only regular files are read",
    () =>
      Effect.gen(function* () {
        const dir = repo()
        const secret = path.join(fs.mkdtempSync(path.join(os.tmpdir(), "abox-secret-")), "state.json")
        fs.writeFileSync(secret, "SECRET-OUTSIDE-THE-REPO\n")
        fs.symlinkSync(secret, path.join(dir, "AGENTS.md"))
        fs.mkdirSync(path.join(dir, "fifo"))
        spawnSync("mkfifo", [path.join(dir, "fifo", "AGENTS.md")])
        fs.mkdirSync(path.join(dir, "d", "CLAUDE.md"), { recursive: true })
        fs.writeFileSync(path.join(dir, "d", "AGENTS.md"), "REAL\n")
        const files = yield* readInstructions({ repoDir: dir, user: undefined, env }).pipe(
          Effect.timeout("20 seconds")
        )
        expect(files).toEqual([{ path: "d/AGENTS.md", text: "REAL\n" }])
      })
  )

  it.live(`at most ${INSTRUCTIONS_MAX_FILES} files are read; the rest are named, not sent`, () =>
    Effect.gen(function* () {
      const dir = repo()
      for (let i = 0; i < INSTRUCTIONS_MAX_FILES + 3; i++) {
        fs.mkdirSync(path.join(dir, `m${String(i).padStart(2, "0")}`))
        fs.writeFileSync(path.join(dir, `m${String(i).padStart(2, "0")}`, "AGENTS.md"), `RULE-${i}\n`)
      }
      const files = yield* readInstructions({ repoDir: dir, user: undefined, env })
      expect(files.filter((f) => f.text !== undefined)).toHaveLength(INSTRUCTIONS_MAX_FILES)
      const section = instructionsSection(files)!
      expect(section).toContain(`RULE-${INSTRUCTIONS_MAX_FILES - 1}\n`)
      expect(section).not.toContain(`RULE-${INSTRUCTIONS_MAX_FILES}\n`)
      expect(section).toContain(`[not included: m${INSTRUCTIONS_MAX_FILES}/AGENTS.md`)
    })
  )

  it("the section: nearest first, cut at the cap, the rest named", () => {
    const section = instructionsSection(
      [
        { path: "AGENTS.md", text: "0123456789" },
        { path: "a/AGENTS.md", text: "abcdefghij" },
        { path: "b/CLAUDE.md", text: "never" }
      ],
      15
    )!
    expect(section).toContain("## AGENTS.md\n0123456789")
    expect(section).toContain("## a/AGENTS.md\nabcde\n")
    expect(section).toContain("[a/AGENTS.md cut: instructions are capped at 15 characters]")
    expect(section).toContain("[not included: b/CLAUDE.md]")
    expect(section).not.toContain("never")
    expect(instructionsSection([{ path: "AGENTS.md", text: "  \n" }])).toBeUndefined()
  })
})

const spec: ModelSpec = {
  provider: "anthropic",
  id: "m",
  endpoint: "https://x",
  hostVariable: "ANTHROPIC_API_KEY"
}

/** a LanguageModel whose streamText fails `failures` times with `status`, then answers */
const scriptedModel = (failures: number, status: number) => {
  let calls = 0
  return Effect.gen(function* () {
    return yield* LanguageModel.make({
      generateText: () => Effect.die("unused"),
      streamText: () =>
        Stream.suspend(() => {
          calls++
          if (calls <= failures) {
            return Stream.fail(
              new AiError.HttpResponseError({
                module: "Test",
                method: "stream",
                reason: "StatusCode",
                request: {
                  method: "POST",
                  url: "https://x/v1/messages",
                  urlParams: [],
                  hash: Option.none(),
                  headers: {}
                },
                response: { status, headers: {} }
              } as never)
            )
          }
          return Stream.make(
            Response.makePart("text-delta", { id: "t", delta: "done" }),
            Response.makePart("finish", {
              reason: "stop",
              usage: new Response.Usage({ inputTokens: 1, outputTokens: 1, totalTokens: 2 })
            })
          ) as never
        })
    })
  }).pipe(Effect.map((model) => ({ model, calls: () => calls })))
}

describe("retries", () => {
  it.effect("429 and 529 are retried with backoff (1 s, 2 s, …), each retry an event", () =>
    Effect.gen(function* () {
      const { model, calls } = yield* scriptedModel(2, 529)
      const events: Array<AgentEvent> = []
      const toolkit = yield* AgentToolkit.pipe(Effect.provide(AgentToolkit.toLayer(handlersFor(repo()))))
      const fiber = yield* promptTurn("hi", { prompt: Prompt.empty }, toolkit, {
        spec,
        maxSteps: 5,
        emit: (e) => Effect.sync(() => void events.push(e)),
        lastRefusal: () => undefined
      }).pipe(Effect.provideService(LanguageModel.LanguageModel, model), Effect.fork)
      // nothing is retried before its delay has passed
      yield* TestClock.adjust("999 millis")
      expect(calls()).toBe(1)
      yield* TestClock.adjust("3 seconds")
      const summary = yield* Fiber.join(fiber)
      expect(calls()).toBe(3)
      expect(summary).toEqual({ reason: "done", steps: 1 })
      expect(events.filter((e) => e.kind === "retry")).toEqual([
        { kind: "retry", attempt: 1, delayMs: 1000, reason: "HTTP 529" },
        { kind: "retry", attempt: 2, delayMs: 2000, reason: "HTTP 529" }
      ])
    })
  )

  it.effect("gives up after 4 retries with the status in the message; 401 is not retried", () =>
    Effect.gen(function* () {
      const toolkit = yield* AgentToolkit.pipe(Effect.provide(AgentToolkit.toLayer(handlersFor(repo()))))
      const { model } = yield* scriptedModel(10, 503)
      const fiber = yield* promptTurn("hi", { prompt: Prompt.empty }, toolkit, {
        spec,
        maxSteps: 5,
        emit: () => Effect.void,
        lastRefusal: () => undefined
      }).pipe(Effect.provideService(LanguageModel.LanguageModel, model), Effect.fork)
      yield* TestClock.adjust("1 minute")
      const summary = yield* Fiber.join(fiber)
      expect(summary.reason).toBe("error")
      expect(summary.message).toContain("503")

      const unauthorized = yield* scriptedModel(10, 401)
      const denied = yield* promptTurn("hi", { prompt: Prompt.empty }, toolkit, {
        spec,
        maxSteps: 5,
        emit: () => Effect.void,
        lastRefusal: () => undefined
      }).pipe(Effect.provideService(LanguageModel.LanguageModel, unauthorized.model))
      expect(unauthorized.calls()).toBe(1)
      expect(denied.message).toContain("ANTHROPIC_API_KEY")
    })
  )
})

describe("compaction", () => {
  const bigConversation = () => {
    const messages: Array<Prompt.MessageEncoded> = []
    for (let i = 0; i < 6; i++) {
      messages.push({ role: "user", content: [{ type: "text", text: `question ${i}` }] })
      messages.push({
        role: "assistant",
        content: [
          {
            type: "tool-call",
            id: `c${i}`,
            name: "shell",
            params: { command: "cat big" },
            providerExecuted: false
          }
        ]
      })
      messages.push({
        role: "tool",
        content: [
          {
            type: "tool-result",
            id: `c${i}`,
            name: "shell",
            isFailure: false,
            providerExecuted: false,
            result: {
              output: "x".repeat(20_000),
              exitCode: 0,
              truncated: false,
              isError: false,
              durationMs: 1
            }
          }
        ]
      })
      messages.push({ role: "assistant", content: [{ type: "text", text: `answer ${i}` }] })
    }
    return Prompt.make(messages)
  }

  it("under the limit nothing changes; over it old tool outputs are trimmed and the user is told", () => {
    const prompt = bigConversation()
    expect(compact(prompt, 1_000_000)).toEqual({ prompt, note: undefined })
    const before = estimateTokens(prompt)
    const { prompt: smaller, note } = compact(prompt, 20_000)
    expect(estimateTokens(smaller)).toBeLessThanOrEqual(20_000)
    expect(estimateTokens(smaller)).toBeLessThan(before)
    expect(note).toContain("trimmed")
    expect(JSON.stringify(smaller)).toContain("output trimmed to save context")
    // the newest exchange is intact
    expect(JSON.stringify(smaller)).toContain("question 5")
  })

  it("when trimming is not enough, the oldest exchanges are dropped at a user turn", () => {
    const { prompt, note } = compact(bigConversation(), 6_000)
    expect(note).toContain("dropped")
    const content = Prompt.make(prompt).content
    const first = content[0]!
    expect(first.role).toBe("user")
    // the first kept turn opens with a deterministic summary of what was dropped
    const parts = first.role === "user" ? first.content : []
    const summary = parts[0]?.type === "text" ? parts[0].text : ""
    expect(summary.startsWith(SUMMARY_MARK)).toBe(true)
    expect(summary).toContain("- user: question 0")
    expect(summary).toContain("  - shell: cat big")
    expect(parts.length).toBe(2)
    // nothing else of the dropped turns is left
    expect(JSON.stringify(content.slice(1))).not.toContain("question 0")
    expect(note).toContain("a short summary kept")

    // compacted again: the earlier summary's lines are carried into the new one, never nested
    const again = compact(Prompt.merge(prompt, bigConversation()), 6_000).prompt.content[0]!
    const againParts = again.role === "user" ? again.content : []
    const text = againParts[0]?.type === "text" ? againParts[0].text : ""
    expect(text).toContain("- user: question 0")
    expect(text.split(SUMMARY_MARK)).toHaveLength(2)
    expect(text.length).toBeLessThanOrEqual(2000)
  })

  it("summaryOf: files touched by path tools, clipped commands", () => {
    const text = summaryOf([
      { role: "user", content: [{ type: "text", text: "fix   it\nplease" }] },
      {
        role: "assistant",
        content: [
          {
            type: "tool-call",
            id: "a",
            name: "edit_file",
            params: { path: "src/a.ts" },
            providerExecuted: false
          },
          {
            type: "tool-call",
            id: "b",
            name: "shell",
            params: { command: "y".repeat(300) },
            providerExecuted: false
          }
        ]
      }
    ])
    expect(text).toContain("- user: fix it please")
    expect(text).toContain("  - edit_file: src/a.ts")
    expect(text).toContain(`  - shell: ${"y".repeat(99)}…`)
    expect(text).toContain("Files touched: src/a.ts")
  })
})

describe("rendering", () => {
  const render = (live: boolean, events: ReadonlyArray<AgentEvent>) => {
    const r = agentRenderer(live)
    let stdout = ""
    let stderr = ""
    for (const e of events) {
      const out = r.render(e as never)
      stdout += out.stdout
      stderr += out.stderr
    }
    return { stdout, stderr, tools: r.toolOutputs() }
  }
  const turn: ReadonlyArray<AgentEvent> = [
    { kind: "text", delta: "Looking\u001b[2J." },
    { kind: "tool_call", id: "1", name: "shell", input: { command: "make test" } },
    {
      kind: "tool_result",
      id: "1",
      name: "shell",
      exitCode: 2,
      output: "boom\n",
      truncated: true,
      isError: true,
      durationMs: 1500
    },
    { kind: "retry", attempt: 1, delayMs: 2000, reason: "HTTP 529" },
    { kind: "text", delta: "Done.\n" },
    { kind: "usage", model: "m", inputTokens: 10, outputTokens: 5, costUsd: 0.0012 },
    {
      kind: "agent_end",
      reason: "max_steps",
      steps: 50,
      message: "stopped after 50 model requests (max steps)"
    }
  ]

  it("every event: text to stdout (escaped), one line per tool call, retry, usage, why it stopped", () => {
    const { stdout, stderr, tools } = render(false, turn)
    expect(stdout).toBe("Looking\\e[2J.\nDone.\n")
    expect(stderr).toBe(
      "  ✗ shell: make test (exit 2)  1.5s (output cut)\n" +
        "  ↻ model request retry 1 in 2.0s (HTTP 529)\n" +
        "  · 10 in / 5 out tokens, $0.0012 (m)\n" +
        "abox: the agent stopped (max_steps): stopped after 50 model requests (max steps)\n"
    )
    expect(tools).toEqual([{ title: "shell: make test", output: "boom\n" }])
  })

  it("on a terminal the tool's line appears when it starts and is completed in place", () => {
    const { stderr } = render(true, turn.slice(1, 3))
    expect(stderr).toBe("  ⋯ shell: make test\r\u001b[2K  ✗ shell: make test (exit 2)  1.5s (output cut)\n")
    const done = render(true, [{ kind: "agent_end", reason: "done", steps: 1 }])
    expect(done.stderr).toBe("")
  })
})
