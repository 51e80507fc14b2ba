/**
 * A shell turn's two paths (records on its output channel, the rest as control messages) merged
 * in the turn's own pull: a control event comes while the channel is silent, `End` only after
 * the channel's EOF whatever order the guest sends them in, and a turn error fails the turn even
 * while its channel stays open.
 */
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll, describe, expect, it } from "@effect/vitest"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Stream from "effect/Stream"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { encodeOutputRecord } from "../src/protocol/TurnOutput.js"
import { GuestRpc, type TurnEvent } from "../src/services/GuestRpc.js"
import { outputGuest } from "./support/outputGuest.js"

const dir = mkdtempSync(join(tmpdir(), "abox-merge-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))
let counter = 0
const socketPath = () => join(dir, `rpc${counter++}.sock`)
const options = { helloTimeout: "5 seconds", shutdownTimeout: "5 seconds" } as const

const describeEvent = (e: TurnEvent): string =>
  e._tag === "End" ? "End" : e.event.kind === "text" ? `text:${e.event.delta}` : `${e.event.kind}:${Buffer.from(e.bytes ?? []).toString()}`

describe("a turn's output channel merged with its control path", () => {
  it.live("a control event comes while the channel is silent; records sent after turn_end still come, End last", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* Effect.flatMap(GuestRpc, (rpc) => rpc.listen(path, options))
      const seenText = yield* Deferred.make<void>()
      let release: (() => void) | undefined
      const gate = new Promise<void>((r) => (release = r))
      const guestP = outputGuest(path, async (mux, m) => {
        const channel = mux.channel(m.output!)
        await mux.sendControl({ type: "agent_event", turn: m.turn, event: { kind: "text", delta: "hi" } })
        await gate // the channel stays open and silent until the host has shown the text event
        // out of the agent's order: turn_end before the channel's last record and EOF
        await mux.sendControl({ type: "turn_end", turn: m.turn, exitCode: 0, signal: null, cancelled: false })
        await channel.write(encodeOutputRecord("stdout", Buffer.from("late")))
        await channel.end()
      })
      const conn = yield* accept
      yield* Effect.promise(() => guestP)
      const seen: Array<string> = []
      const fiber = yield* Stream.runForEach(conn.turn("t"), (e) =>
        Effect.sync(() => seen.push(describeEvent(e))).pipe(
          Effect.zipRight(e._tag === "Event" ? Deferred.succeed(seenText, undefined) : Effect.void)
        )
      ).pipe(Effect.fork)
      yield* Deferred.await(seenText)
      expect(seen).toEqual(["text:hi"])
      release!()
      yield* Fiber.join(fiber)
      expect(seen).toEqual(["text:hi", "stdout:late", "End"])
    }).pipe(Effect.scoped, Effect.provide(GuestRpcLive))
  )

  it.live("a turn error fails the turn while its channel stays open", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* Effect.flatMap(GuestRpc, (rpc) => rpc.listen(path, options))
      const guestP = outputGuest(path, async (mux, m) => {
        mux.channel(m.output!) // opened, never written nor ended
        await mux.sendControl({ type: "error", turn: m.turn, code: "boom", message: "the turn broke" })
      })
      const conn = yield* accept
      yield* Effect.promise(() => guestP)
      const exit = yield* Effect.exit(Stream.runCollect(conn.turn("t")))
      expect(Exit.isFailure(exit)).toBe(true)
      expect(JSON.stringify(exit)).toContain("the turn broke")
    }).pipe(Effect.scoped, Effect.provide(GuestRpcLive))
  )
})
