/**
 * broker.log under a burst: 1,000 tunnels logging at once through the broker's writer, against
 * the floor of the same 1,000 lines appended by one plain write. Goal: a few times the floor
 * (a lock per line, each release waking every waiter, took seconds and hundreds of MB).
 */
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Effect from "effect/Effect"
import * as fs from "node:fs"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import { type BrokerLogEntry, openBrokerLog } from "../src/broker/log.js"
import { type BenchContext, type Figure, median, round } from "./lib.js"

const LINES = 1000

const entry = (channel: number): BrokerLogEntry => ({
  time: new Date().toISOString(),
  channel,
  event: "open",
  host: "api.example.com",
  port: 443,
  decision: "allow",
  mode: "terminate",
  credential: false
})

export const brokerLogBurst = async (ctx: BenchContext): Promise<Figure> => {
  const dir = fs.mkdtempSync(path.join(ctx.tmp, "broker-log-"))
  const viaWriter = async (i: number) => {
    const file = path.join(dir, `writer-${i}.log`)
    const start = performance.now()
    await Effect.runPromise(
      Effect.scoped(
        Effect.gen(function* () {
          const log = yield* openBrokerLog(file)
          yield* Effect.forEach(
            Array.from({ length: LINES }, (_, c) => c),
            (c) => log.write(entry(c)),
            {
              concurrency: "unbounded",
              discard: true
            }
          )
        })
      ).pipe(Effect.provide(NodeFileSystem.layer))
    )
    return performance.now() - start
  }
  const floor = (i: number) => {
    const file = path.join(dir, `floor-${i}.log`)
    const start = performance.now()
    const text = Array.from({ length: LINES }, (_, c) => JSON.stringify(entry(c)) + "\n").join("")
    fs.appendFileSync(file, text, { mode: 0o600 })
    return performance.now() - start
  }
  await viaWriter(-1)
  floor(-1)
  const writer: Array<number> = []
  const floors: Array<number> = []
  for (let i = 0; i < ctx.runs; i++) {
    writer.push(await viaWriter(i))
    floors.push(floor(i))
  }
  const medianMs = median(writer)
  const floorMs = median(floors)
  return {
    ratio: round(medianMs / floorMs),
    medianMs: round(medianMs),
    floorMs: round(floorMs),
    runs: ctx.runs,
    note: `${LINES} concurrent broker.log lines through the batching writer vs one plain append of the same lines`
  }
}
