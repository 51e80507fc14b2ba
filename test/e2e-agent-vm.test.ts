/**
 * The model agent in a real VM (QEMU, the small test image): a scripted model (the mock, reached
 * through the broker by `resolve`) reads a failing test, edits the source with edit_file, runs
 * the test with the shell tool, sees it pass and answers. Checked: the file changed in the guest,
 * the tool ran as the unprivileged owner (uid ≠ 0) and could not read the agent's state, the
 * real key reached the mock while the guest saw only the placeholder, context.json (on the
 * guest disk) holds the conversation, cancel mid-stream and mid-tool leaves nothing running, and
 * after close + resume the next request carries the earlier messages. A VM killed mid-turn
 * loses no finished step: context.json is saved after each one.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Stream from "effect/Stream"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import type { BrokerPolicy } from "../src/broker/policy.js"
import type { AgentEvent } from "../src/protocol/Messages.js"
import { open, resume, type Session } from "../src/programs/session.js"
import type { TurnEvent } from "../src/services/GuestRpc.js"
import { ensureTestImage, testHome, vmSkipReason, vmSessionLayer } from "./e2e-vm-image.js"
import { startModelMock } from "./support/modelMock.js"
import { processesMentioning } from "./support/processes.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e agent VM test skipped: ${skip}`)
const hasDebugfs = spawnSync("debugfs", ["-V"]).status === 0

const eventsOf = (events: Iterable<TurnEvent>): Array<AgentEvent> =>
  Array.from(events).flatMap((e) => (e._tag === "Event" ? [e.event] : []))
const stdoutOf = (events: Iterable<TurnEvent>) =>
  eventsOf(events)
    .map((e) => (e.kind === "stdout" ? e.data : ""))
    .join("")

const collect = (session: Session, text: string, mode: "shell" | "prompt") =>
  Stream.runCollect(session.turn(text, mode)).pipe(Effect.map((c) => Chunk.toReadonlyArray(c)))

describe.skipIf(skip !== undefined)("the model agent in a real VM", () => {
  it.live(
    "fixes a failing test with edit_file and the shell tool; key on the host only; cancel; resume carries the conversation",
    () =>
      Effect.gen(function* () {
        yield* Effect.promise(() => ensureTestImage())
        const mock = yield* Effect.acquireRelease(
          Effect.promise(() => startModelMock()),
          (m) => Effect.promise(() => m.close())
        )
        const canary = `sk-ant-api03-agentcanary${Math.random().toString(36).slice(2)}x9`
        const previousKey = process.env.ANTHROPIC_API_KEY
        process.env.ANTHROPIC_API_KEY = canary
        yield* Effect.addFinalizer(() =>
          Effect.sync(() => {
            if (previousKey === undefined) delete process.env.ANTHROPIC_API_KEY
            else process.env.ANTHROPIC_API_KEY = previousKey
          })
        )
        const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-agent-"))
        fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
        const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-agent-src-"))
        fs.writeFileSync(path.join(source, "sum.js"), "module.exports = (a, b) => a - b\n")
        fs.writeFileSync(
          path.join(source, "test.js"),
          "const sum = require('./sum.js')\nif (sum(2, 3) !== 5) { console.log('FAIL'); process.exit(1) }\nconsole.log('PASS')\n"
        )
        // no allow rule, no credential: the catalog's provider (sonnet → Anthropic) brings its
        // preset because ANTHROPIC_API_KEY is set; resolve pins its host to the mock
        const policy: BrokerPolicy = {
          format: 1,
          allow: [],
          credentials: [],
          resolve: { "api.anthropic.com": `127.0.0.1:${mock.port}` }
        }
        const layer = vmSessionLayer(home, mock.caPem)

        mock.push(
          {
            kind: "tools",
            text: "Let me look at the test.",
            calls: [{ name: "read_file", input: { path: "test.js" } }]
          },
          { kind: "tools", calls: [{ name: "read_file", input: { path: "sum.js" } }] },
          {
            kind: "tools",
            calls: [
              { name: "edit_file", input: { path: "sum.js", old_string: "a - b", new_string: "a + b" } }
            ]
          },
          {
            kind: "tools",
            calls: [
              {
                name: "shell",
                input: {
                  command:
                    'node test.js; echo "uid=$(id -u) key=$ANTHROPIC_API_KEY"; ' +
                    "cat /var/lib/abox/context.json >/dev/null 2>&1 || echo state-unreadable; " +
                    "touch /var/lib/abox/x 2>/dev/null || echo state-unwritable; " +
                    // the agent (node, root) cannot be signalled; the owner's own nodes (its file
                    // operations' child) are its to signal and are left out
                    'for p in $(pidof node); do [ "$(stat -c %u /proc/$p)" = "$(id -u)" ] && continue; kill -0 $p 2>/dev/null && echo "signalled $p"; done; echo signal-check-done'
                }
              }
            ]
          },
          { kind: "text", chunks: ["The test passes now: ", "sum adds."] }
        )

        const id = yield* Effect.gen(function* () {
          const id = yield* Effect.scoped(
            Effect.gen(function* () {
              const session = yield* open({ source, policy })
              const fixed = eventsOf(yield* collect(session, "fix the failing test", "prompt"))
              const results = fixed.filter((e) => e.kind === "tool_result")
              expect(results.map((r) => [r.name, r.isError])).toEqual([
                ["read_file", false],
                ["read_file", false],
                ["edit_file", false],
                ["shell", false]
              ])
              const shell = results[3]!.output
              expect(shell).toContain("PASS")
              expect(shell).toMatch(/uid=[1-9]\d* key=abox-placeholder/)
              expect(shell).toContain("state-unreadable")
              expect(shell).toContain("state-unwritable")
              expect(shell).toContain("signal-check-done")
              expect(shell).not.toContain("signalled")
              expect(shell).not.toContain(canary)
              expect(fixed.at(-1)).toMatchObject({ kind: "agent_end", reason: "done", steps: 5 })
              expect(
                fixed
                  .filter((e) => e.kind === "text")
                  .map((e) => e.delta)
                  .join("")
              ).toBe("Let me look at the test.The test passes now: sum adds.")
              // the file changed in the guest
              expect(stdoutOf(yield* collect(session, "cat sum.js", "shell"))).toBe(
                "module.exports = (a, b) => a + b\n"
              )

              // cancel mid-stream: the stream hangs after its first delta
              mock.push({ kind: "hang", chunks: ["thinking"] })
              const midStream = yield* session.turn("think forever", "prompt").pipe(
                Stream.takeUntil((e) => e._tag === "Event" && e.event.kind === "text"),
                Stream.runCollect
              )
              expect(eventsOf(midStream).some((e) => e.kind === "text")).toBe(true)

              // cancel mid-tool: the shell tool sleeps; the turn is interrupted once it started
              mock.push({ kind: "tools", calls: [{ name: "shell", input: { command: "sleep 347" } }] })
              const sawCall = yield* Deferred.make<void>()
              const midTool = yield* session.turn("sleep", "prompt").pipe(
                Stream.tap((e) =>
                  e._tag === "Event" && e.event.kind === "tool_call"
                    ? Deferred.succeed(sawCall, undefined)
                    : Effect.void
                ),
                Stream.runDrain,
                Effect.fork
              )
              yield* Deferred.await(sawCall)
              // the tool is running (its result never came): cancel it
              yield* Effect.sleep("3 seconds")
              yield* Fiber.interrupt(midTool)
              // nothing of it is left
              const ps = stdoutOf(yield* collect(session, "ps -o pid,args 2>/dev/null || ps", "shell"))
              expect(ps).not.toContain("sleep 347")
              return session.id
            })
          )
          // context.json (root-only in the guest) holds the conversation: read from the guest disk
          if (hasDebugfs) {
            // a qcow2 root (an overlay of the golden) is read through a raw copy: debugfs reads raw ext4
            const sessionDir = path.join(home, "sessions", id)
            let rootDisk = path.join(sessionDir, "root.raw")
            if (fs.existsSync(path.join(sessionDir, "root.qcow2"))) {
              rootDisk = path.join(fs.mkdtempSync(path.join(os.tmpdir(), "abox-context-")), "root.raw")
              const converted = spawnSync("qemu-img", ["convert", "-O", "raw", path.join(sessionDir, "root.qcow2"), rootDisk])
              expect(converted.status, String(converted.stderr)).toBe(0)
            }
            const dump = spawnSync("debugfs", ["-R", "cat /var/lib/abox/context.json", rootDisk], {
              encoding: "utf8"
            })
            if (rootDisk !== path.join(sessionDir, "root.raw")) fs.rmSync(path.dirname(rootDisk), { recursive: true })
            const context = JSON.parse(dump.stdout) as { format: number; messages: Array<{ role: string }> }
            expect(context.format).toBe(2)
            expect(JSON.stringify(context.messages)).toContain("fix the failing test")
            expect(JSON.stringify(context.messages)).toContain("PASS")
            expect(JSON.stringify(context)).not.toContain(canary)
          }
          mock.push({ kind: "text", chunks: ["Yes, it passes."] })
          yield* Effect.scoped(
            Effect.gen(function* () {
              const session = yield* resume(id)
              const again = eventsOf(yield* collect(session, "are you sure?", "prompt"))
              expect(again.at(-1)).toMatchObject({ kind: "agent_end", reason: "done" })
            })
          )
          return id
        }).pipe(Effect.provide(layer))

        const last = JSON.stringify(mock.requests.at(-1)!.body)
        expect(last).toContain("fix the failing test")
        expect(last).toContain("PASS")
        expect(last).toContain("are you sure?")
        // the real key reached the mock on every request; nothing else held it
        expect(mock.requests.map((r) => r.headers["x-api-key"])).toEqual(mock.requests.map(() => canary))
        const dir = path.join(home, "sessions", id)
        for (const file of ["config.raw", "guest-config.json", "console.log", "broker.log", "session.json"]) {
          if (fs.existsSync(path.join(dir, file))) {
            expect(fs.readFileSync(path.join(dir, file)).includes(canary), file).toBe(false)
          }
        }
      }).pipe(Effect.scoped),
    900_000
  )

  it.live(
    "a VM killed mid-turn keeps the finished steps: the resumed conversation carries them",
    () =>
      Effect.gen(function* () {
        yield* Effect.promise(() => ensureTestImage())
        const mock = yield* Effect.acquireRelease(
          Effect.promise(() => startModelMock()),
          (m) => Effect.promise(() => m.close())
        )
        const previousKey = process.env.ANTHROPIC_API_KEY
        process.env.ANTHROPIC_API_KEY = `sk-ant-api03-killcanary${Math.random().toString(36).slice(2)}x9`
        yield* Effect.addFinalizer(() =>
          Effect.sync(() => {
            if (previousKey === undefined) delete process.env.ANTHROPIC_API_KEY
            else process.env.ANTHROPIC_API_KEY = previousKey
          })
        )
        const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-agent-kill-"))
        fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
        const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-agent-kill-src-"))
        fs.writeFileSync(path.join(source, "README.md"), "hello\n")
        const policy: BrokerPolicy = {
          format: 1,
          allow: [],
          credentials: [],
          resolve: { "api.anthropic.com": `127.0.0.1:${mock.port}` }
        }
        // step 1 runs a tool (its output is computed, so only the result carries the mark);
        // step 2's answer never ends: the VM is killed while the model "thinks"
        mock.push(
          { kind: "tools", calls: [{ name: "shell", input: { command: "echo STEP-ONE-$((6*7))" } }] },
          { kind: "hang", chunks: ["thinking"] }
        )
        const id = yield* Effect.gen(function* () {
          const id = yield* Effect.scoped(
            Effect.gen(function* () {
              const session = yield* open({ source, policy })
              const n = mock.requests.length
              const turn = yield* session
                .turn("two steps, then the VM dies", "prompt")
                .pipe(Stream.runDrain, Effect.either, Effect.fork)
              // the second request went out: the first step is finished (and saved before it)
              yield* Effect.promise(() => mock.untilRequest(n + 2))
              const vm = processesMentioning(session.dir)
              expect(vm.length).toBeGreaterThan(0)
              for (const pid of vm) process.kill(pid, "SIGKILL")
              const ended = yield* Fiber.join(turn)
              expect(ended._tag).toBe("Left")
              return session.id
            })
          )
          mock.push({ kind: "text", chunks: ["carried on"] })
          yield* Effect.scoped(
            Effect.gen(function* () {
              const session = yield* resume(id)
              const again = eventsOf(yield* collect(session, "after the crash", "prompt"))
              expect(again.at(-1)).toMatchObject({ kind: "agent_end", reason: "done" })
            })
          )
          return id
        }).pipe(Effect.provide(vmSessionLayer(home, mock.caPem)))
        expect(id).not.toBe("")
        const last = JSON.stringify(mock.requests.at(-1)!.body)
        expect(last).toContain("two steps, then the VM dies")
        expect(last).toContain("STEP-ONE-42")
        expect(last).toContain("after the crash")
      }).pipe(Effect.scoped),
    900_000
  )
})
