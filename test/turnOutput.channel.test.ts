/**
 * A shell turn's output on its own data channel (FEATURE_OUTPUT): records byte-exact and in
 * order, the host reads only as fast as the turn's consumer (the channel's credit stops the
 * guest), a malformed record is a protocol error, and the CLI's writer waits for a full stdout.
 */
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { Writable } from "node:stream"
import { afterAll, describe, expect, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import { writeOutput } from "../src/cli/turnOutput.js"
import { ByteChunker } from "../src/guest/turns.js"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { INITIAL_WINDOW, type Mux } from "../src/protocol/Mux.js"
import {
  encodeOutputRecord,
  MAX_OUTPUT_RECORD,
  OutputRecordDecoder,
  OutputRecordError
} from "../src/protocol/TurnOutput.js"
import { GuestRpc, type TurnEvent } from "../src/services/GuestRpc.js"
import { outputGuest } from "./support/outputGuest.js"

const dir = mkdtempSync(join(tmpdir(), "abox-output-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))
let counter = 0
const socketPath = () => join(dir, `rpc${counter++}.sock`)
const options = { helloTimeout: "5 seconds", shutdownTimeout: "5 seconds" } as const

const turnEnd = (mux: Mux, turn: number) =>
  mux.sendControl({ type: "turn_end", turn, exitCode: 0, signal: null, cancelled: false })

const bytesOf = (events: ReadonlyArray<TurnEvent>, kind: "stdout" | "stderr") =>
  Buffer.concat(
    events.flatMap((e) =>
      e._tag === "Event" && e.event.kind === kind && e.bytes !== undefined ? [e.bytes] : []
    )
  )

/** waits (real time) until `value` has not changed for a while: the writer is blocked */
const settled = (value: () => number) =>
  Effect.promise(async () => {
    let last = -1
    let same = 0
    while (same < 10) {
      await new Promise((r) => setTimeout(r, 30))
      const now = value()
      same = now === last ? same + 1 : 0
      last = now
    }
    return last
  })

describe("turn output records", () => {
  it("decode byte-exact across any cut, and reject a malformed record", () => {
    const records = [
      encodeOutputRecord("stdout", Buffer.from("héllo\n")),
      encodeOutputRecord("stderr", Buffer.from([0xff, 0x00, 0xfe])),
      encodeOutputRecord("stdout", Buffer.alloc(MAX_OUTPUT_RECORD, 0x61))
    ]
    const wire = Buffer.concat(records)
    for (const step of [1, 3, 7, 4096, wire.length]) {
      const decoder = new OutputRecordDecoder()
      const got: Array<[string, Buffer]> = []
      for (let i = 0; i < wire.length; i += step) {
        for (const r of decoder.push(wire.subarray(i, i + step))) got.push([r.kind, Buffer.from(r.bytes)])
      }
      decoder.end()
      expect(got.map(([kind, bytes]) => [kind, bytes.length])).toEqual([
        ["stdout", 7],
        ["stderr", 3],
        ["stdout", MAX_OUTPUT_RECORD]
      ])
      expect(got[1]![1].equals(Buffer.from([0xff, 0x00, 0xfe]))).toBe(true)
    }
    expect(() => new OutputRecordDecoder().push(Buffer.from([3, 0, 0, 0, 1, 0x41]))).toThrow(
      OutputRecordError
    )
    const oversized = Buffer.from([1, 0, 0, 0, 0])
    oversized.writeUInt32BE(MAX_OUTPUT_RECORD + 1, 1)
    expect(() => new OutputRecordDecoder().push(oversized)).toThrow(OutputRecordError)
    const cut = new OutputRecordDecoder()
    cut.push(records[0]!.subarray(0, 4))
    expect(() => cut.end()).toThrow(OutputRecordError)
  })

  it("the guest's pieces keep UTF-8 sequences whole and are byte-exact", () => {
    const chunker = new ByteChunker(8)
    const text = Buffer.from("aaaaaaa€€€ bytes \u{1f600}")
    const pieces = [...chunker.push(text.subarray(0, 9)), ...chunker.push(text.subarray(9)), ...chunker.end()]
    expect(Buffer.concat(pieces).equals(text)).toBe(true)
    for (const piece of pieces) {
      expect(piece.length).toBeLessThanOrEqual(8)
      expect(Buffer.from(piece).toString("utf8")).not.toContain("\ufffd")
    }
  })
})

describe("a turn's output channel (GuestRpcLive, real unix socket)", () => {
  it.live(
    "the host reads only as its consumer does (the guest stops within a window), then resumes; bytes and order exact",
    () =>
      Effect.gen(function* () {
        const path = socketPath()
        const { accept } = yield* Effect.flatMap(GuestRpc, (rpc) => rpc.listen(path, options))
        const total = 24 * 1024 * 1024
        const record = 64 * 1024
        let written = 0
        let finished = false
        const sent: Array<Buffer> = []
        const guestP = outputGuest(path, async (mux, m) => {
          expect(m.output).toBeDefined()
          const channel = mux.channel(m.output!)
          for (let i = 0; written < total; i++) {
            const bytes = Buffer.alloc(record, i % 251)
            bytes.writeUInt32BE(i, 0)
            // stdout and stderr alternate: their order must survive
            const kind = i % 3 === 2 ? "stderr" : "stdout"
            sent.push(Buffer.concat([Buffer.from([kind === "stdout" ? 1 : 2]), bytes]))
            await channel.write(encodeOutputRecord(kind, bytes))
            written += record
          }
          await channel.end()
          finished = true
          await turnEnd(mux, m.turn)
        })
        const conn = yield* accept
        yield* Effect.promise(() => guestP)
        const pull = yield* Stream.toPull(conn.turn("produce"))
        let first = yield* pull
        while (Chunk.isEmpty(first)) first = yield* pull
        // nobody reads: the guest is held by the channel's credit, far below what it has to send
        const stalled = yield* settled(() => written)
        expect(finished).toBe(false)
        expect(stalled).toBeLessThan(INITIAL_WINDOW + 16 * record)
        // reading again resumes it, to the end
        const events: Array<TurnEvent> = [...Chunk.toReadonlyArray(first)]
        for (;;) {
          const next = yield* Effect.option(pull)
          if (Option.isNone(next)) break
          events.push(...Chunk.toReadonlyArray(next.value))
        }
        expect(finished).toBe(true)
        expect(events.at(-1)).toMatchObject({ _tag: "End", exitCode: 0 })
        const got = Buffer.concat(
          events.flatMap((e) =>
            e._tag === "Event" && e.bytes !== undefined
              ? [Buffer.from([e.event.kind === "stdout" ? 1 : 2]), e.bytes]
              : []
          )
        )
        // records arrive whole here (each ≤ one mux frame), so kind + bytes line up one to one
        expect(got.equals(Buffer.concat(sent))).toBe(true)
        expect(bytesOf(events, "stdout").length + bytesOf(events, "stderr").length).toBe(total)
      }).pipe(Effect.scoped, Effect.provide(GuestRpcLive))
  )

  it.live("a malformed record fails the turn with a ProtocolError; non-UTF-8 bytes keep base64", () =>
    Effect.gen(function* () {
      const path = socketPath()
      const { accept } = yield* Effect.flatMap(GuestRpc, (rpc) => rpc.listen(path, options))
      let turns = 0
      const guestP = outputGuest(path, async (mux, m) => {
        const channel = mux.channel(m.output!)
        if (turns++ === 0) {
          await channel.write(encodeOutputRecord("stdout", Buffer.from([0xff, 0x41])))
          await channel.end()
          await turnEnd(mux, m.turn)
          return
        }
        await channel.write(Buffer.from([9, 0, 0, 0, 1, 0x41]))
      })
      const conn = yield* accept
      yield* Effect.promise(() => guestP)
      const events = Chunk.toReadonlyArray(yield* Stream.runCollect(conn.turn("one")))
      expect(events[0]).toMatchObject({ _tag: "Event", event: { kind: "stdout", base64: "/0E=" } })
      const bad = yield* Effect.exit(Stream.runDrain(conn.turn("two")))
      expect(Exit.isFailure(bad)).toBe(true)
      expect(JSON.stringify(bad)).toContain("ProtocolError")
    }).pipe(Effect.scoped, Effect.provide(GuestRpcLive))
  )
})

describe("the CLI's output writer", () => {
  it.live("waits while its stream is full and goes on at drain", () =>
    Effect.gen(function* () {
      const taken: Array<Buffer> = []
      let release: (() => void) | undefined
      const slow = new Writable({
        highWaterMark: 4,
        write(chunk: Buffer, _encoding, done) {
          taken.push(chunk)
          release = done
        }
      })
      const fiber = yield* Effect.fork(writeOutput(slow, Buffer.from("0123456789")))
      yield* Effect.promise(() => new Promise((r) => setTimeout(r, 50)))
      expect(fiber.unsafePoll()).toBeNull()
      release!()
      yield* Fiber.join(fiber)
      expect(Buffer.concat(taken).toString()).toBe("0123456789")
    })
  )
})
