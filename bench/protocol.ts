import * as net from "node:net"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { FEATURE_EXPORT, FEATURE_OUTPUT } from "../src/protocol/Messages.js"
import { GUEST_RECEIVE_WINDOW, Mux } from "../src/protocol/Mux.js"
import { GuestRpc, type GuestConnection } from "../src/services/GuestRpc.js"
import { type BenchContext, type Figure, median, round } from "./lib.js"

/**
 * Protocol figures, with an in-process scripted guest on a real unix socket (no VM):
 * - turnRoundTrip: a no-op shell turn (user_turn → turn_end, with the output channel a real
 *   guest's "output" feature gives it) through GuestRpc + Mux vs a raw
 *   unix-socket echo of one small message (goal ≤ 3×); the note adds CPU time per turn (steadier
 *   than wall time on a loaded machine) and what one Stream.runDrain alone costs.
 * - transfer50MB: 50 MB through GuestRpc.transfer (Mux, credit flow control) vs the same bytes
 *   written raw over a unix socket (goal ≥ 0.7× the floor's throughput; ratio = throughput).
 */

const TURNS_PER_RUN = 300
const TRANSFER_BYTES = 50 * 1024 * 1024
const CHUNK = 64 * 1024

let counter = 0
const socketIn = (ctx: BenchContext) => path.join(ctx.tmp, `proto-${process.pid}-${counter++}.sock`)

/**
 * a fake guest: hello/ready, no-op turns, transfers counted and acknowledged; its receive window
 * and features are the guest agent's (src/guest/agent.ts), advertised in hello as the agent does:
 * with "output" a shell turn's host opens an output channel, which the guest ends (EOF, then
 * dropped) before turn_end, as the agent does for a command that prints nothing
 */
const startGuest = (socketPath: string): Promise<net.Socket> =>
  new Promise((resolve, reject) => {
    const socket = net.connect(socketPath)
    socket.once("error", reject)
    socket.once("connect", () => {
      const mux = new Mux(socket, { receiveWindow: GUEST_RECEIVE_WINDOW })
      mux.onError(() => undefined)
      mux.onControl(async (m) => {
        switch (m.type) {
          case "user_turn":
            if (m.output !== undefined) {
              const output = mux.channel(m.output)
              await output.end()
              output.destroy("turn output sent")
            }
            return mux.sendControl({
              type: "turn_end",
              turn: m.turn,
              exitCode: 0,
              signal: null,
              cancelled: false
            })
          case "transfer_begin":
            return (async () => {
              let bytes = 0
              for await (const c of mux.channel(m.channel).readable) bytes += c.length
              await mux.sendControl({ type: "transfer_end", channel: m.channel, files: 1, bytes })
            })()
          case "shutdown":
            return mux.close()
        }
      })
      void mux.sendControl({
        type: "hello",
        protocol: 4,
        arch: "x86_64",
        build: "bench",
        window: GUEST_RECEIVE_WINDOW,
        features: [FEATURE_EXPORT, FEATURE_OUTPUT]
      })
      void mux.sendControl({ type: "ready" })
      resolve(socket)
    })
  })

/** runs `body` against a connected GuestRpc session; the scope closes (shutdown) afterwards */
const withConnection = async <A>(
  ctx: BenchContext,
  body: (conn: GuestConnection) => Effect.Effect<A, unknown>
) => {
  const socketPath = socketIn(ctx)
  const program = Effect.gen(function* () {
    const rpc = yield* GuestRpc
    const { accept } = yield* rpc.listen(socketPath, {
      helloTimeout: "10 seconds",
      shutdownTimeout: "10 seconds"
    })
    const guest = startGuest(socketPath)
    const conn = yield* accept
    yield* Effect.promise(() => guest)
    return yield* body(conn)
  })
  return Effect.runPromise(
    Effect.flatMap(Scope.make(), (scope) =>
      Scope.extend(program, scope).pipe(Effect.onExit(() => Scope.close(scope, Exit.void)))
    ).pipe(Effect.provide(GuestRpcLive))
  )
}

/** a raw echo server and a client: one small message out, the same back */
const rawPair = (socketPath: string): Promise<{ client: net.Socket; server: net.Server }> =>
  new Promise((resolve) => {
    const server = net.createServer((s) => s.pipe(s))
    server.listen(socketPath, () => {
      const client = net.connect(socketPath, () => resolve({ client, server }))
      client.setNoDelay?.(true)
    })
  })

const echoRoundTrips = async (client: net.Socket, n: number): Promise<number> => {
  const message = Buffer.from(JSON.stringify({ type: "user_turn", turn: 1, text: "true" }))
  const start = performance.now()
  for (let i = 0; i < n; i++) {
    await new Promise<void>((resolve) => {
      let got = 0
      const onData = (c: Buffer) => {
        got += c.length
        if (got >= message.length) {
          client.off("data", onData)
          resolve()
        }
      }
      client.on("data", onData)
      client.write(message)
    })
  }
  return (performance.now() - start) / n
}

/** CPU time (user + system, this process: host and scripted peer alike) per iteration, in µs */
const cpuPer = (since: NodeJS.CpuUsage, n: number): number => {
  const used = process.cpuUsage(since)
  return (used.user + used.system) / n
}

export const turnRoundTrip = async (ctx: BenchContext): Promise<Figure> => {
  const { client, server } = await rawPair(socketIn(ctx))
  // turn and floor runs alternate, so that both see the same load on a shared machine
  const { muxMs, muxCpu, streamMs, floorMs, floorCpu } = await withConnection(ctx, (conn) =>
    Effect.gen(function* () {
      const perRun: Array<number> = []
      const cpuRuns: Array<number> = []
      const streamRuns: Array<number> = []
      const floorRuns: Array<number> = []
      const floorCpuRuns: Array<number> = []
      for (let r = 0; r <= ctx.runs; r++) {
        const cpu = process.cpuUsage()
        const start = performance.now()
        for (let i = 0; i < TURNS_PER_RUN; i++) yield* Stream.runDrain(conn.turn("true"))
        if (r > 0) perRun.push((performance.now() - start) / TURNS_PER_RUN) // run 0 warms up
        if (r > 0) cpuRuns.push(cpuPer(cpu, TURNS_PER_RUN))
        // what any Stream costs its consumer here: one element through Stream.runDrain
        const streamStart = performance.now()
        for (let i = 0; i < TURNS_PER_RUN; i++) yield* Stream.runDrain(Stream.make(i))
        if (r > 0) streamRuns.push((performance.now() - streamStart) / TURNS_PER_RUN)
        const echoCpu = process.cpuUsage()
        const echoMs = yield* Effect.promise(() => echoRoundTrips(client, TURNS_PER_RUN))
        if (r > 0) floorRuns.push(echoMs)
        if (r > 0) floorCpuRuns.push(cpuPer(echoCpu, TURNS_PER_RUN))
      }
      return {
        muxMs: median(perRun),
        muxCpu: median(cpuRuns),
        streamMs: median(streamRuns),
        floorMs: median(floorRuns),
        floorCpu: median(floorCpuRuns)
      }
    })
  )
  client.destroy()
  server.close()
  return {
    ratio: round(muxMs / floorMs),
    medianMs: round(muxMs, 4),
    floorMs: round(floorMs, 4),
    runs: ctx.runs,
    goal: 3,
    note:
      `ms per no-op shell turn (user_turn → turn_end; the guest lists "output", so the turn opens its output channel, as with the agent), ` +
      `${TURNS_PER_RUN} turns per run; floor: raw unix-socket echo, runs alternating; ` +
      `CPU per turn ${round(muxCpu, 0)} µs vs ${round(floorCpu, 0)} µs per echo; ` +
      `Stream.runDrain of a one-element Stream alone: ${round(streamMs, 4)} ms = ${round(streamMs / floorMs)}× the echo`
  }
}

/**
 * The same no-op turn on the bare Mux (no Effect): what the protocol itself costs, separate from
 * GuestRpc's Effect Stream per turn.
 */
export const muxRoundTrip = async (ctx: BenchContext): Promise<Figure> => {
  const socketPath = socketIn(ctx)
  const server = net.createServer((s) => {
    const guest = new Mux(s)
    guest.onControl((m) => {
      if (m.type === "user_turn") {
        return guest.sendControl({
          type: "turn_end",
          turn: m.turn,
          exitCode: 0,
          signal: null,
          cancelled: false
        })
      }
    })
  })
  await new Promise<void>((resolve) => server.listen(socketPath, resolve))
  const socket = net.connect(socketPath)
  await new Promise((resolve) => socket.once("connect", resolve))
  const host = new Mux(socket)
  let waiter: (() => void) | undefined
  host.onControl(() => waiter?.())
  const { client, server: echo } = await rawPair(socketIn(ctx))
  // mux and floor runs alternate, so that both see the same load on a shared machine
  const muxRuns: Array<number> = []
  const floorRuns: Array<number> = []
  for (let r = 0; r <= ctx.runs; r++) {
    const start = performance.now()
    for (let i = 0; i < TURNS_PER_RUN; i++) {
      await new Promise<void>((resolve) => {
        waiter = resolve
        void host.sendControl({ type: "user_turn", turn: i + 1, text: "true" })
      })
    }
    const muxMs = (performance.now() - start) / TURNS_PER_RUN
    const floorMs = await echoRoundTrips(client, TURNS_PER_RUN)
    if (r > 0) {
      muxRuns.push(muxMs)
      floorRuns.push(floorMs)
    }
  }
  host.destroy()
  server.close()
  client.destroy()
  echo.close()
  const muxMs = median(muxRuns)
  const floorMs = median(floorRuns)
  return {
    ratio: round(muxMs / floorMs),
    medianMs: round(muxMs, 4),
    floorMs: round(floorMs, 4),
    runs: ctx.runs,
    goal: 2,
    note: "ms per user_turn → turn_end on the bare Mux (Schema-validated both ways); floor: raw unix-socket echo"
  }
}

const rawTransfer = (socketPath: string): Promise<number> =>
  new Promise((resolve) => {
    const server = net.createServer((s) => {
      let got = 0
      s.on("data", (c: Buffer) => {
        got += c.length
        if (got >= TRANSFER_BYTES) s.end(Buffer.from([1]))
      })
    })
    server.listen(socketPath, () => {
      const client = net.connect(socketPath, async () => {
        const chunk = new Uint8Array(CHUNK)
        const start = performance.now()
        client.once("data", () => {
          const ms = performance.now() - start
          client.destroy()
          server.close()
          resolve(ms)
        })
        for (let sent = 0; sent < TRANSFER_BYTES; sent += CHUNK) {
          if (!client.write(chunk)) await new Promise((r) => client.once("drain", r))
        }
      })
    })
  })

export const transfer50MB = async (ctx: BenchContext): Promise<Figure> => {
  // one buffer sent over and over, as the floor does: the figure measures the transport, not allocation
  const block = new Uint8Array(CHUNK)
  const tar = Stream.range(1, TRANSFER_BYTES / CHUNK).pipe(Stream.map(() => block))
  // mux and floor runs alternate, so that both see the same load on a shared machine
  const [muxMs, floorMs] = await withConnection(ctx, (conn) =>
    Effect.gen(function* () {
      const muxRuns: Array<number> = []
      const floorRuns: Array<number> = []
      for (let r = 0; r <= ctx.runs; r++) {
        const start = performance.now()
        const result = yield* conn.transfer(tar, "/work/repo")
        if (result.bytes !== TRANSFER_BYTES) return yield* Effect.die(`guest got ${result.bytes} bytes`)
        const muxMs = performance.now() - start
        const floorMs = yield* Effect.promise(() => rawTransfer(socketIn(ctx)))
        if (r > 0) {
          muxRuns.push(muxMs)
          floorRuns.push(floorMs)
        }
      }
      return [median(muxRuns), median(floorRuns)] as const
    })
  )
  return {
    ratio: round(floorMs / muxMs),
    medianMs: round(muxMs, 1),
    floorMs: round(floorMs, 1),
    runs: ctx.runs,
    goal: 0.7,
    note: `ratio = throughput vs the raw pipe; Mux ${round(TRANSFER_BYTES / 1048576 / (muxMs / 1000), 0)} MiB/s, floor ${round(TRANSFER_BYTES / 1048576 / (floorMs / 1000), 0)} MiB/s`
  }
}
