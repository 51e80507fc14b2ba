/**
 * The model agent's own overhead per step, over the fake backend (the real guest agent and model
 * bundle as host processes, the real broker), against the scripted model mock:
 * - agentFirstRequest: from sending a prompt turn to the model request arriving at the mock
 *   (model bundle loaded: the session's first prompt turn is reported apart, in the note) vs the
 *   same request sent to the mock directly from here (goal: ≤ 50 ms over the floor)
 * - agentToolRoundTrip: from the end of the mock's answer asking for `shell {command: "true"}` to
 *   the next request (tool result included) arriving vs spawning `true` as the tool user
 *   (goal: ≤ 1.5×)
 * - agentFileToolRoundTrip: the same for `read_file {path: "README.md"}` (done by the owner's
 *   file-operation child, started by the session's first file tool), against the same floor
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Stream from "effect/Stream"
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import { Agent, fetch as undiciFetch } from "undici"
import * as FakeVmm from "../src/layers/FakeVmm.js"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { httpsBrokerLayer } from "../src/broker/HttpsBrokerLive.js"
import { FakeImages } from "../src/layers/Lifecycle.js"
import { RuntimeLockLive } from "../src/layers/RuntimeLockLive.js"
import { SessionStoreLive } from "../src/layers/SessionStoreLive.js"
import type { BrokerPolicy } from "../src/broker/policy.js"
import { open } from "../src/programs/session.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { startModelMock, type MockStep, type ModelMock } from "../test/support/modelMock.js"
import { type BenchContext, type Figure, median, round } from "./lib.js"

interface Measured {
  readonly cold: number
  readonly firstRequest: ReadonlyArray<number>
  readonly toolRoundTrip: ReadonlyArray<number>
  readonly fileToolRoundTrip: ReadonlyArray<number>
  /** the session's first file tool (its child starts) */
  readonly fileToolCold: number
  /** TLS connections the mock accepted for the session's requests (reuse shows as fewer) */
  readonly connections: number
  readonly requests: number
}

const measureSession = async (ctx: BenchContext, mock: ModelMock): Promise<Measured> => {
  const home = fs.mkdtempSync(path.join(ctx.tmp, "agent-"))
  const repo = fs.mkdtempSync(path.join(ctx.tmp, "agent-repo-"))
  fs.writeFileSync(path.join(repo, "README.md"), "bench\n")
  const policy: BrokerPolicy = {
    format: 1,
    allow: [],
    credentials: [],
    resolve: { "api.anthropic.com": `127.0.0.1:${mock.port}` }
  }
  const layer = Layer.mergeAll(
    SessionStoreLive,
    RuntimeLockLive,
    GuestRpcLive,
    httpsBrokerLayer({ extraUpstreamCa: [mock.caPem] }),
    FakeVmm.layer,
    FakeImages
  ).pipe(
    Layer.provideMerge(aboxPathsAt(home)),
    Layer.provideMerge(NodeCommandExecutor.layer),
    Layer.provideMerge(NodeFileSystem.layer)
  )
  const firstRequest: Array<number> = []
  const toolRoundTrip: Array<number> = []
  const fileToolRoundTrip: Array<number> = []
  let fileToolCold = 0
  let cold = 0
  const before = mock.connections()
  const requestsBefore = mock.requests.length
  await Effect.runPromise(
    Effect.scoped(
      Effect.gen(function* () {
        const session = yield* open({ source: repo, policy })
        const prompt = (steps: ReadonlyArray<MockStep>) =>
          Effect.gen(function* () {
            mock.push(...steps)
            const n = mock.requests.length
            const started = performance.now()
            yield* Stream.runDrain(session.turn("go", "prompt"))
            return { started, requests: mock.requests.slice(n) }
          })
        const first = yield* prompt([{ kind: "text", chunks: ["ok"] }])
        cold = first.requests[0]!.arrivedAt - first.started
        const readFile = () =>
          prompt([
            { kind: "tools", calls: [{ name: "read_file", input: { path: "README.md" } }] },
            { kind: "text", chunks: ["ok"] }
          ])
        const firstRead = yield* readFile()
        fileToolCold = firstRead.requests[1]!.arrivedAt - firstRead.requests[0]!.endedAt!
        for (let i = 0; i < ctx.runs; i++) {
          const turn = yield* prompt([{ kind: "text", chunks: ["ok"] }])
          firstRequest.push(turn.requests[0]!.arrivedAt - turn.started)
          const tool = yield* prompt([
            { kind: "tools", calls: [{ name: "shell", input: { command: "true" } }] },
            { kind: "text", chunks: ["ok"] }
          ])
          toolRoundTrip.push(tool.requests[1]!.arrivedAt - tool.requests[0]!.endedAt!)
          const read = yield* readFile()
          fileToolRoundTrip.push(read.requests[1]!.arrivedAt - read.requests[0]!.endedAt!)
        }
      })
    ).pipe(Effect.provide(layer))
  )
  return {
    cold,
    firstRequest,
    toolRoundTrip,
    fileToolRoundTrip,
    fileToolCold,
    connections: mock.connections() - before,
    requests: mock.requests.length - requestsBefore
  }
}

/** the same request, sent to the mock straight from here */
const directRequests = async (ctx: BenchContext, mock: ModelMock): Promise<ReadonlyArray<number>> => {
  const dispatcher = new Agent({ connect: { ca: mock.caPem, servername: "api.anthropic.com" } })
  const times: Array<number> = []
  try {
    for (let i = 0; i <= ctx.runs; i++) {
      mock.push({ kind: "text", chunks: ["ok"] })
      const n = mock.requests.length
      const started = performance.now()
      const response = await undiciFetch(`https://127.0.0.1:${mock.port}/v1/messages`, {
        method: "POST",
        headers: { "content-type": "application/json", "x-api-key": "bench" },
        body: JSON.stringify({
          model: "m",
          max_tokens: 10,
          stream: true,
          messages: [{ role: "user", content: "go" }]
        }),
        dispatcher
      })
      await response.text()
      if (i > 0) times.push(mock.requests[n]!.arrivedAt - started)
    }
  } finally {
    await dispatcher.close()
  }
  return times
}

/** spawning `true` as the user tools run as (nobody under root, as the fake guest does) */
const spawnTrue = async (ctx: BenchContext): Promise<ReadonlyArray<number>> => {
  const root = process.getuid?.() === 0
  const times: Array<number> = []
  for (let i = 0; i <= ctx.runs; i++) {
    const started = performance.now()
    await new Promise<void>((resolve, reject) => {
      const child = spawn("true", [], {
        stdio: ["ignore", "pipe", "pipe"],
        detached: true,
        ...(root ? { uid: 65534, gid: 65534 } : {})
      })
      child.once("error", reject)
      child.once("close", () => resolve())
    })
    if (i > 0) times.push(performance.now() - started)
  }
  return times
}

let measured: Promise<{ session: Measured; direct: ReadonlyArray<number> }> | undefined
const measure = (ctx: BenchContext) =>
  (measured ??= (async () => {
    const previous = process.env.ANTHROPIC_API_KEY
    process.env.ANTHROPIC_API_KEY = "bench-key"
    const mock = await startModelMock()
    try {
      const direct = await directRequests(ctx, mock)
      const session = await measureSession(ctx, mock)
      return { session, direct }
    } finally {
      await mock.close()
      if (previous === undefined) delete process.env.ANTHROPIC_API_KEY
      else process.env.ANTHROPIC_API_KEY = previous
    }
  })())

export const agentFirstRequest = async (ctx: BenchContext): Promise<Figure> => {
  const { session, direct } = await measure(ctx)
  const medianMs = median(session.firstRequest)
  const floorMs = median(direct)
  return {
    ratio: round(medianMs / floorMs),
    medianMs: round(medianMs),
    floorMs: round(floorMs),
    runs: ctx.runs,
    note:
      `${round(medianMs - floorMs)} ms over the floor (goal ≤ 50 ms; host → fake guest → CONNECT → broker → mock); ` +
      `the session's first prompt turn, which loads the model bundle: ${round(session.cold)} ms; ` +
      `${session.connections} upstream TLS connections for ${session.requests} model requests`
  }
}

export const agentToolRoundTrip = async (ctx: BenchContext): Promise<Figure> => {
  const { session } = await measure(ctx)
  const floor = await spawnTrue(ctx)
  const medianMs = median(session.toolRoundTrip)
  const floorMs = median(floor)
  return {
    ratio: round(medianMs / floorMs),
    medianMs: round(medianMs),
    floorMs: round(floorMs),
    runs: ctx.runs,
    goal: 1.5,
    note: "answer asking for shell `true` ends → next request (with the result) arrives, vs spawning `true` as the tool user"
  }
}

export const agentFileToolRoundTrip = async (ctx: BenchContext): Promise<Figure> => {
  const { session } = await measure(ctx)
  const floor = await spawnTrue(ctx)
  const medianMs = median(session.fileToolRoundTrip)
  const floorMs = median(floor)
  return {
    ratio: round(medianMs / floorMs),
    medianMs: round(medianMs),
    floorMs: round(floorMs),
    runs: ctx.runs,
    note:
      "answer asking for read_file README.md ends → next request (with the result) arrives, vs spawning `true` as the tool user; " +
      `the session's first file tool (its owner child starts): ${round(session.fileToolCold)} ms`
  }
}
