/**
 * `--agent claude` and `--agent codex` with a real VM, one boot of the workstation image (which
 * carries both CLIs): each preset's argv (src/lib/agentPresets.ts) runs as a turn, as the
 * unprivileged user in /work/repo, against the scripted mock of its provider's API
 * (test/support/modelMock.ts) reached through the guest's proxy and the host's broker (the
 * `anthropic` / `openai` presets; the policy's `resolve` sends api.*.com to the mock). Each CLI
 * completes a turn: one tool call that runs a shell command in the repository, then a final
 * answer. The real keys arrive at the mock; the guest holds only placeholders.
 */
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { agentPreset } from "../src/lib/agentPresets.js"
import { BROKER_LOG_FILE, readBrokerLog } from "../src/broker/log.js"
import { type BrokerPolicy, presetRules, withRules } from "../src/broker/policy.js"
import { open } from "../src/programs/session.js"
import type { TurnEvent } from "../src/services/GuestRpc.js"
import { ensureWorkstationImage, testHome, workstationSkipReason, vmSessionLayer } from "./e2e-vm-image.js"
import { startModelMock } from "./support/modelMock.js"

const skip = workstationSkipReason()
if (skip !== undefined) console.warn(`e2e agent CLIs VM test skipped: ${skip}`)

interface Outcome {
  readonly out: string
  readonly exitCode: number | null
}
const outcomeOf = (events: ReadonlyArray<TurnEvent>): Outcome => {
  let out = ""
  let exitCode: number | null = null
  for (const e of events) {
    if (e._tag === "Event" && (e.event.kind === "stdout" || e.event.kind === "stderr")) out += e.event.data
    if (e._tag === "End") exitCode = e.exitCode
  }
  return { out, exitCode }
}

const quote = (word: string) => `'${word.replaceAll("'", `'\\''`)}'`
/** a preset's argv as a shell turn, its prompt on stdin as the agent turn gives it */
const presetTurn = (name: string, prompt: string) =>
  `printf '%s' ${quote(prompt)} | ${agentPreset([name])!.argv.map(quote).join(" ")} 2>/tmp/${name}.err; ` +
  `status=$?; tail -c 2000 /tmp/${name}.err >&2; exit $status`

/** the JSON objects among a CLI's output lines */
const jsonLines = (out: string): ReadonlyArray<Record<string, unknown>> =>
  out.split("\n").flatMap((line) => {
    try {
      const value: unknown = JSON.parse(line)
      return typeof value === "object" && value !== null ? [value as Record<string, unknown>] : []
    } catch {
      return []
    }
  })

describe.skipIf(skip !== undefined)("agent CLIs in the workstation image with a real VM", () => {
  it.live(
    "Claude Code and Codex each complete a turn (tool call in /work/repo as the unprivileged user, then an answer) against the mock, through the broker with the host's key",
    () =>
      Effect.gen(function* () {
        const image = yield* Effect.promise(() => ensureWorkstationImage())
        const mock = yield* Effect.acquireRelease(
          Effect.promise(() => startModelMock({ names: ["api.anthropic.com"] })),
          (m) => Effect.promise(() => m.close())
        )
        const work = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-clis-"))
        yield* Effect.addFinalizer(() => Effect.sync(() => fs.rmSync(work, { recursive: true, force: true })))
        const secrets = {
          ANTHROPIC_API_KEY: `sk-ant-canary-${Math.random().toString(36).slice(2)}`,
          OPENAI_API_KEY: `sk-openai-canary-${Math.random().toString(36).slice(2)}`
        }
        const saved = {
          ANTHROPIC_API_KEY: process.env.ANTHROPIC_API_KEY,
          OPENAI_API_KEY: process.env.OPENAI_API_KEY
        }
        Object.assign(process.env, secrets)
        yield* Effect.addFinalizer(() =>
          Effect.sync(() => {
            for (const [name, value] of Object.entries(saved)) {
              if (value === undefined) delete process.env[name]
              else process.env[name] = value
            }
          })
        )
        const explicit: BrokerPolicy = {
          format: 1,
          allow: [],
          credentials: [],
          resolve: {
            "api.anthropic.com": `127.0.0.1:${mock.port}`,
            "api.openai.com": `127.0.0.1:${mock.port}`
          }
        }
        const policy = withRules(
          withRules(explicit, presetRules("anthropic", { fromEnv: "ANTHROPIC_API_KEY" })),
          presetRules("openai", { fromEnv: "OPENAI_API_KEY" })
        )
        const source = path.join(work, "repo")
        fs.mkdirSync(source)
        fs.writeFileSync(path.join(source, "README.md"), "a repository for the agent CLIs\n")

        // Claude Code: a Bash tool call, then the answer
        mock.push(
          {
            kind: "tools",
            calls: [
              {
                name: "Bash",
                input: { command: "echo from-claude > claude.txt && id -un", description: "write a file" }
              }
            ]
          },
          { kind: "text", chunks: ["claude ", "is done"] }
        )

        const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-clis-home-"))
        fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
        yield* Effect.addFinalizer(() => Effect.sync(() => fs.rmSync(home, { recursive: true, force: true })))
        const layer = vmSessionLayer(home, mock.caPem)

        const results = yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* open({
              source,
              policy,
              image: `${image.identity.name}@${image.identity.digest}`,
              memoryMiB: 2048
            })
            const run = (text: string) =>
              Effect.map(Stream.runCollect(session.turn(text)), (events) =>
                outcomeOf(Chunk.toReadonlyArray(events))
              )
            const env = yield* run("env; command -v claude; command -v codex")
            const claude = yield* run(presetTurn("claude", "write claude.txt, then say you are done"))
            const claudeRequests = mock.requests.length
            // Codex: exec_command (its shell tool), then the answer
            mock.push(
              {
                kind: "tools",
                calls: [{ name: "exec_command", input: { cmd: "echo from-codex > codex.txt && id -un" } }]
              },
              { kind: "text", chunks: ["codex ", "is done"] }
            )
            const codex = yield* run(presetTurn("codex", "write codex.txt, then say you are done"))
            const files = yield* run(
              "cd /work/repo && stat -c '%U %n' claude.txt codex.txt && cat claude.txt codex.txt"
            )
            return { env, claude, claudeRequests, codex, files, id: session.id }
          })
        ).pipe(Effect.provide(layer))
        const log = yield* readBrokerLog(path.join(home, "sessions", results.id, BROKER_LOG_FILE)).pipe(
          Effect.provide(NodeFileSystem.layer)
        )

        const show = (outcome: Outcome) => outcome.out.slice(-4000)
        // the guest holds placeholders only, and both CLIs
        for (const name of Object.keys(secrets)) expect(results.env.out).toContain(`${name}=abox-placeholder`)
        for (const value of Object.values(secrets)) expect(results.env.out).not.toContain(value)
        expect(results.env.out).toContain("/usr/local/bin/claude")
        expect(results.env.out).toContain("/usr/local/bin/codex")

        // Claude Code: stream-json events, the tool ran as the unprivileged user, the answer came back
        expect(results.claude.exitCode, show(results.claude)).toBe(0)
        const claudeEvents = jsonLines(results.claude.out)
        expect(
          claudeEvents.some((e) => e.type === "system"),
          show(results.claude)
        ).toBe(true)
        expect(JSON.stringify(claudeEvents.filter((e) => e.type === "user"))).toContain("agent")
        const claudeResult = claudeEvents.find((e) => e.type === "result")
        expect(claudeResult?.result, show(results.claude)).toBe("claude is done")

        // Codex: exec --json events, the command ran as the unprivileged user, the answer came back
        expect(results.codex.exitCode, show(results.codex)).toBe(0)
        const codexItems = jsonLines(results.codex.out).flatMap((e) =>
          e.type === "item.completed" ? [e.item as Record<string, unknown>] : []
        )
        const command = codexItems.find((item) => item.type === "command_execution")
        expect(command?.aggregated_output, show(results.codex)).toBe("agent\n")
        expect(codexItems.find((item) => item.type === "agent_message")?.text, show(results.codex)).toBe(
          "codex is done"
        )

        // the files the tools wrote, in the repository, owned by the unprivileged user
        expect(results.files.out, results.files.out).toContain("agent claude.txt")
        expect(results.files.out).toContain("agent codex.txt")
        expect(results.files.out).toContain("from-claude\nfrom-codex\n")

        // at the mock: the real keys (the broker's), never a placeholder
        const messages = mock.requests.slice(0, results.claudeRequests).filter((r) => r.method === "POST")
        expect(messages.map((r) => r.path)).toEqual(["/v1/messages", "/v1/messages"])
        for (const request of messages) expect(request.headers["x-api-key"]).toBe(secrets.ANTHROPIC_API_KEY)
        const responses = mock.requests.slice(results.claudeRequests).filter((r) => r.method === "POST")
        expect(responses.map((r) => r.path)).toEqual(["/v1/responses", "/v1/responses"])
        for (const request of responses) {
          expect(request.headers.authorization).toBe(`Bearer ${secrets.OPENAI_API_KEY}`)
        }
        for (const request of mock.requests)
          expect(JSON.stringify(request.headers)).not.toContain("abox-placeholder")
        // what else the CLIs tried (Codex: github.com, api.github.com, chatgpt.com) was denied and logged
        const denied = new Set(log.entries.filter((e) => e.decision === "deny").map((e) => e.host))
        expect([...denied], JSON.stringify([...denied])).toEqual(expect.arrayContaining(["chatgpt.com"]))
      }).pipe(Effect.scoped),
    1_800_000
  )
})
