/**
 * The model agent's file tools on special files in a real VM (QEMU, the small test image, the
 * bundled guest): the turn user makes a FIFO; write_file, read_file, edit_file and list_files
 * on it are refused at once and the turn ends. Then the user stops every node process of its
 * own (a watcher in its own session), so the child doing a write_file for it never answers: a
 * cancel ends the turn, the child is gone, and the next turn runs.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import type { BrokerPolicy } from "../src/broker/policy.js"
import type { AgentEvent } from "../src/protocol/Messages.js"
import { open, type Session } from "../src/programs/session.js"
import type { TurnEvent } from "../src/services/GuestRpc.js"
import { ensureTestImage, testHome, vmSkipReason, vmSessionLayer } from "./e2e-vm-image.js"
import { startModelMock } from "./support/modelMock.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e guest-root VM test skipped: ${skip}`)

const eventsOf = (events: Iterable<TurnEvent>): Array<AgentEvent> =>
  Array.from(events).flatMap((e) => (e._tag === "Event" ? [e.event] : []))
const stdoutOf = (events: Iterable<TurnEvent>) =>
  eventsOf(events)
    .map((e) => (e.kind === "stdout" ? e.data : ""))
    .join("")
const collect = (session: Session, text: string, mode: "shell" | "prompt") =>
  Stream.runCollect(session.turn(text, mode)).pipe(Effect.map((c) => Chunk.toReadonlyArray(c)))

/** processes whose command line is the file-operation child's (the pattern does not match itself) */
const COUNT_CHILDREN = `grep -l "only regular fil[e]s" /proc/[0-9]*/cmdline 2>/dev/null | wc -l`

describe.skipIf(skip !== undefined)("the file tools on special files, in a real VM", () => {
  it.live(
    "a FIFO is refused by every file tool; a stalled file operation is ended by a cancel; the next turn runs",
    () =>
      Effect.gen(function* () {
        yield* Effect.promise(() => ensureTestImage())
        const mock = yield* Effect.acquireRelease(
          Effect.promise(() => startModelMock()),
          (m) => Effect.promise(() => m.close())
        )
        const previousKey = process.env.ANTHROPIC_API_KEY
        process.env.ANTHROPIC_API_KEY = "sk-ant-api03-guestroot-test"
        yield* Effect.addFinalizer(() =>
          Effect.sync(() => {
            if (previousKey === undefined) delete process.env.ANTHROPIC_API_KEY
            else process.env.ANTHROPIC_API_KEY = previousKey
          })
        )
        const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-guestroot-"))
        fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
        const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-guestroot-src-"))
        fs.writeFileSync(path.join(source, "a.txt"), "one\n")
        yield* Effect.addFinalizer(() =>
          Effect.sync(() => {
            fs.rmSync(home, { recursive: true, force: true })
            fs.rmSync(source, { recursive: true, force: true })
          })
        )
        const policy: BrokerPolicy = {
          format: 1,
          allow: [],
          credentials: [],
          resolve: { "api.anthropic.com": `127.0.0.1:${mock.port}` }
        }

        mock.push(
          { kind: "tools", calls: [{ name: "shell", input: { command: "mkfifo pipe && echo made" } }] },
          {
            kind: "tools",
            calls: [
              { name: "write_file", input: { path: "pipe", content: "into the pipe" } },
              { name: "read_file", input: { path: "pipe" } },
              { name: "edit_file", input: { path: "pipe", old_string: "a", new_string: "b" } },
              { name: "list_files", input: { path: "pipe" } }
            ]
          },
          { kind: "text", chunks: ["done"] }
        )

        yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* open({ source, policy })
            const first = eventsOf(yield* collect(session, "the pipe", "prompt"))
            const results = first.filter((e) => e.kind === "tool_result")
            expect(results.map((r) => [r.name, r.isError])).toEqual([
              ["shell", false],
              ["write_file", true],
              ["read_file", true],
              ["edit_file", true],
              ["list_files", true]
            ])
            for (const r of results.slice(1, 3)) expect(r.output).toContain("is a FIFO")
            // nothing of the FIFO was read, so no edit gets as far as opening it
            expect(results[3]!.output).toContain("with read_file before editing it")
            expect(first.at(-1)).toMatchObject({ kind: "agent_end", reason: "done" })

            // the user stops its own node processes: the file operation's child never answers
            mock.push(
              {
                kind: "tools",
                calls: [
                  {
                    name: "shell",
                    input: {
                      command:
                        "setsid sh -c 'echo $$ > watcher.pid; while :; do for p in $(pidof node); do kill -STOP $p 2>/dev/null; done; done' " +
                        "</dev/null >/dev/null 2>&1 & sleep 1; echo watching"
                    }
                  }
                ]
              },
              { kind: "tools", calls: [{ name: "write_file", input: { path: "stalled.txt", content: "x" } }] }
            )
            const sawWrite = yield* Deferred.make<void>()
            const stalled = yield* session.turn("stall", "prompt").pipe(
              Stream.tap((e) =>
                e._tag === "Event" && e.event.kind === "tool_call" && e.event.name === "write_file"
                  ? Deferred.succeed(sawWrite, undefined)
                  : Effect.void
              ),
              Stream.runCollect,
              Effect.fork
            )
            yield* Deferred.await(sawWrite)
            yield* Effect.sleep("3 seconds")
            // no result came: the operation is stuck
            expect(stalled.unsafePoll()).toBeNull()
            yield* Fiber.interrupt(stalled)

            const check = stdoutOf(
              yield* collect(
                session,
                `kill $(cat watcher.pid); sleep 0.5; ${COUNT_CHILDREN}; echo next-turn`,
                "shell"
              )
            )
            expect(check).toMatch(/^\s*0\s*\nnext-turn\n$/)
            mock.push(
              {
                kind: "tools",
                calls: [{ name: "write_file", input: { path: "after.txt", content: "after\n" } }]
              },
              { kind: "text", chunks: ["ok"] }
            )
            const after = eventsOf(yield* collect(session, "write after", "prompt"))
            expect(after.filter((e) => e.kind === "tool_result").map((r) => [r.name, r.isError])).toEqual([
              ["write_file", false]
            ])
            expect(stdoutOf(yield* collect(session, "cat after.txt; stat -c %u after.txt", "shell"))).toMatch(
              /^after\n[1-9]\d*\n$/
            )
          })
        ).pipe(Effect.provide(vmSessionLayer(home, mock.caPem)))
      }).pipe(Effect.scoped),
    600_000
  )
})
