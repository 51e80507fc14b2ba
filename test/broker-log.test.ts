/**
 * broker.log's writer and reader: one batched write for many concurrent lines, a bounded queue
 * with counted drops, rate-limited denials, capped fields, rotation, a streaming reader, and
 * guest-chosen text escaped when printed.
 */
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as FileSystem from "@effect/platform/FileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Stream from "effect/Stream"
import * as path from "node:path"
import {
  type BrokerLogEntry,
  type BrokerLogOptions,
  formatBrokerLogEntry,
  openBrokerLog,
  readBrokerLog,
  rotatedLogPath,
  streamBrokerLog
} from "../src/broker/log.js"
import { hasControl } from "../src/lib/text.js"

const entry = (channel: number, over: Partial<BrokerLogEntry> = {}): BrokerLogEntry => ({
  time: "2026-01-01T00:00:00.000Z",
  channel,
  event: "open",
  host: "api.example.com",
  port: 443,
  decision: "allow",
  credential: false,
  ...over
})

/** node's FileSystem, counting the writes made to opened files */
const countingFs = Effect.gen(function* () {
  const fs = yield* FileSystem.FileSystem
  const counter = { writes: 0 }
  const wrapped: FileSystem.FileSystem = {
    ...fs,
    open: (p, o) =>
      Effect.map(fs.open(p, o), (file) => {
        const write = file.write.bind(file)
        const writeAll = file.writeAll.bind(file)
        return Object.assign(Object.create(Object.getPrototypeOf(file) as object) as typeof file, file, {
          write: (buffer: Uint8Array) => {
            counter.writes++
            return write(buffer)
          },
          writeAll: (buffer: Uint8Array) => {
            counter.writes++
            return writeAll(buffer)
          }
        })
      })
  }
  return { fs: wrapped, counter }
}).pipe(Effect.provide(NodeFileSystem.layer))

const withLog = <A>(
  options: BrokerLogOptions,
  body: (
    writer: Effect.Effect.Success<ReturnType<typeof openBrokerLog>>,
    file: string,
    counter: { writes: number }
  ) => Effect.Effect<A, unknown>
) =>
  Effect.gen(function* () {
    const { fs, counter } = yield* countingFs
    const dir = yield* fs.makeTempDirectoryScoped({ prefix: "abox-broker-log-" })
    const file = path.join(dir, "broker.log")
    const result = yield* Effect.scoped(
      Effect.gen(function* () {
        const writer = yield* openBrokerLog(file, options)
        return yield* body(writer, file, counter)
      })
    ).pipe(Effect.provide(Layer.succeed(FileSystem.FileSystem, fs)))
    const read = yield* readBrokerLog(file).pipe(Effect.provide(Layer.succeed(FileSystem.FileSystem, fs)))
    return { result, read, file, counter, fs }
  }).pipe(Effect.provide(NodeFileSystem.layer))

describe("broker.log writer", () => {
  it.scopedLive(
    "5,000 concurrent lines (more than the queue holds): all written, in a handful of batched writes, none interleaved",
    () =>
      Effect.gen(function* () {
        const { read, counter } = yield* withLog({}, (writer) =>
          Effect.forEach(
            Array.from({ length: 5000 }, (_, i) => i),
            (i) => writer.write(entry(i)),
            {
              concurrency: "unbounded",
              discard: true
            }
          )
        )
        expect(read.badLines).toEqual([])
        expect(read.entries).toHaveLength(5000)
        expect(new Set(read.entries.map((e) => e.channel)).size).toBe(5000)
        // one write per batch, not per line (a lock per line made this 5,000 writes, each waking every waiter)
        expect(counter.writes).toBeLessThan(50)
      })
  )

  it.scopedLive(
    "lines queued from callbacks past the queue bound are dropped and counted, never waited for",
    () =>
      Effect.gen(function* () {
        const { read } = yield* withLog({ maxQueued: 10 }, (writer) =>
          Effect.sync(() => {
            for (let i = 0; i < 100; i++) writer.enqueue(entry(i))
          })
        )
        expect(read.entries.filter((e) => e.event === "open")).toHaveLength(10)
        expect(read.entries.filter((e) => e.event === "suppressed")).toEqual([
          expect.objectContaining({ reason: "queue-full", count: 90 })
        ])
      })
  )

  it.scopedLive("repeated denials are rate-limited per kind and in total, with the count written", () =>
    Effect.gen(function* () {
      const deny = (i: number, host: string) =>
        entry(i, { decision: "deny", reason: "host-not-allowed", host })
      const { read } = yield* withLog({ denialsPerKey: 5, denialsPerWindow: 20 }, (writer) =>
        Effect.gen(function* () {
          for (let i = 0; i < 50; i++) yield* writer.write(deny(i, "same.example"))
          for (let i = 0; i < 50; i++) yield* writer.write(deny(i, `h${i}.example`))
          // allowed lines are never rate-limited
          for (let i = 0; i < 30; i++) yield* writer.write(entry(i))
        })
      )
      const denials = read.entries.filter((e) => e.event === "open" && e.decision === "deny")
      expect(denials).toHaveLength(20)
      expect(denials.filter((e) => e.host === "same.example")).toHaveLength(5)
      expect(read.entries.filter((e) => e.decision === "allow")).toHaveLength(30)
      expect(read.entries.filter((e) => e.event === "suppressed")).toEqual([
        expect.objectContaining({ reason: "rate-limited", count: 80 })
      ])
    })
  )

  it.scopedLive("a 1 MiB host name is cut; the file rotates at its size; the reader streams both parts", () =>
    Effect.gen(function* () {
      const huge = "a".repeat(1024 * 1024)
      const { read, file, fs } = yield* withLog({ rotateBytes: 4096 }, (writer) =>
        Effect.gen(function* () {
          yield* writer.write(entry(0, { host: huge, decision: "deny", reason: huge }))
          for (let i = 1; i <= 200; i++) yield* writer.write(entry(i))
        })
      )
      const current = yield* fs.stat(file)
      const rotated = yield* fs.stat(rotatedLogPath(file))
      expect(Number(current.size)).toBeLessThan(4096 + 1024)
      expect(Number(rotated.size)).toBeLessThan(4096 + 1024)
      expect((current.mode & 0o777).toString(8)).toBe("600")
      // one generation is kept: the last lines are there, in order
      const channels = read.entries.map((e) => e.channel)
      expect(channels[channels.length - 1]).toBe(200)
      expect(channels).toEqual([...channels].sort((a, b) => a - b))
      const lines = yield* streamBrokerLog(file).pipe(
        Stream.runCollect,
        Effect.map(Chunk.toReadonlyArray),
        Effect.provide(NodeFileSystem.layer)
      )
      expect(lines).toHaveLength(read.entries.length)
      expect(lines[lines.length - 1]).toContain("#200")
    })
  )

  it.scopedLive("a huge host name is written cut to its bound", () =>
    Effect.gen(function* () {
      const { read } = yield* withLog({}, (writer) =>
        writer.write(entry(0, { host: "b".repeat(1024 * 1024), decision: "deny", reason: "invalid-host" }))
      )
      expect(read.entries[0]!.host.length).toBeLessThan(300)
      expect(read.entries[0]!.host).toMatch(/^b{256}…\(1048576 chars\)$/)
    })
  )
})

describe("broker.log printed", () => {
  it("guest-chosen host names cannot drive the terminal", () => {
    const hostile = "x\u001b]0;owned\u0007\u001b[2J\u009b31m\b\b\rFAKE\u202e"
    const line = formatBrokerLogEntry(
      entry(1, { host: hostile, decision: "deny", reason: `r\u001b[1m`, method: "G\u001bET" })
    )
    expect(hasControl(line)).toBe(false)
    expect(line).toContain("x\\e]0;owned\\x07\\e[2J\\x9b31m\\b\\b\\rFAKE\\u{202e}:443")
  })

  it.live("the reader streams lines that do not decode as such, and a missing log as nothing", () =>
    Effect.gen(function* () {
      const fs = yield* FileSystem.FileSystem
      const dir = yield* fs.makeTempDirectoryScoped()
      const file = path.join(dir, "broker.log")
      const none = yield* Stream.runCollect(streamBrokerLog(file))
      expect(Chunk.size(none)).toBe(0)
      yield* fs.writeFileString(file, `not json\n${JSON.stringify(entry(3))}\n\n`)
      const lines = Chunk.toReadonlyArray(yield* Stream.runCollect(streamBrokerLog(file)))
      expect(lines[0]).toBe("(unreadable line 1)")
      expect(lines[1]).toContain("#3")
      expect(lines).toHaveLength(2)
      // a log that cannot be read is an error, not an empty log
      const broken = path.join(dir, "broken")
      yield* fs.makeDirectory(path.join(broken, "broker.log"), { recursive: true })
      const failed = yield* Stream.runCollect(streamBrokerLog(path.join(broken, "broker.log"))).pipe(
        Effect.flip
      )
      expect(failed._tag).toBe("SystemError")
    }).pipe(Effect.scoped, Effect.provide(NodeFileSystem.layer))
  )
})
