/**
 * The broker's cost on the guest's path, host-side: a client → the guest CONNECT proxy →
 * an in-memory tunnel (standing in for a protocol v4 channel) → HttpsBroker (TLS termination
 * and credential injection: the costly mode) → an HTTPS server on 127.0.0.1; against the same
 * client talking to the same server directly. Goals: ≥ 0.8× throughput, ≤ +2 ms per request.
 */
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Queue from "effect/Queue"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import type * as http from "node:http"
import * as https from "node:https"
import * as net from "node:net"
import * as path from "node:path"
import { performance } from "node:perf_hooks"
import type { Duplex } from "node:stream"
import * as tls from "node:tls"
import { startConnectProxy } from "../src/guest/connectProxy.js"
import { makeHttpsBroker } from "../src/broker/HttpsBrokerLive.js"
import { decodePolicy } from "../src/broker/policy.js"
import type { TunnelRequest } from "../src/services/GuestRpc.js"
import { inMemoryTunnel, startUpstream } from "../test/support/brokerHarness.js"
import { type BenchContext, type Figure, median, round } from "./lib.js"

const NAME = "bench.local"
const DOWNLOAD_BYTES = 100 * 1024 * 1024
const SMALL_REQUESTS = 1000

interface Rig {
  readonly direct: https.Agent
  readonly brokered: https.Agent
  readonly port: number
  readonly close: () => Promise<void>
}

/** an https.Agent whose connections are CONNECT tunnels through the proxy */
class ProxyAgent extends https.Agent {
  constructor(
    private readonly proxyPort: number,
    options: https.AgentOptions
  ) {
    super(options)
  }
  override createConnection(
    options: tls.ConnectionOptions & { host?: string; port?: number },
    callback: (error: Error | null, socket?: Duplex) => void
  ) {
    const socket = net.connect({ host: "127.0.0.1", port: this.proxyPort })
    socket.once("connect", () =>
      socket.write(`CONNECT ${options.host}:${options.port} HTTP/1.1\r\nHost: ${options.host}\r\n\r\n`)
    )
    socket.once("error", (error) => callback(error))
    let head = Buffer.alloc(0)
    const onData = (chunk: Buffer) => {
      head = Buffer.concat([head, chunk])
      const end = head.indexOf("\r\n\r\n")
      if (end < 0) return
      socket.off("data", onData)
      if (!head.subarray(0, end).toString().startsWith("HTTP/1.1 200"))
        return callback(new Error(head.toString()))
      socket.pause()
      callback(null, tls.connect({ ...options, socket, servername: NAME }))
    }
    socket.on("data", onData)
    return undefined as unknown as Duplex
  }
}

const makeRig = async (tmp: string, mode: "terminate" | "passthrough" = "terminate"): Promise<Rig> => {
  const upstream = await startUpstream(NAME)
  process.env.ABOX_BENCH_KEY = "bench-secret"
  const scope = Effect.runSync(Scope.make())
  const session = await Effect.runPromise(
    Effect.gen(function* () {
      const policy = yield* decodePolicy({
        format: 1,
        allow: [{ host: NAME, ports: [upstream.port] }],
        credentials:
          mode === "terminate" ? [{ host: NAME, header: "x-api-key", fromEnv: "ABOX_BENCH_KEY" }] : [],
        resolve: { [NAME]: "127.0.0.1" }
      })
      const broker = yield* makeHttpsBroker({ extraUpstreamCa: [upstream.caPem] })
      const sessionDir = fs.mkdtempSync(path.join(tmp, "broker-session-"))
      const session = yield* broker.make(policy, { sessionId: "bench", sessionDir })
      const queue = yield* Queue.unbounded<TunnelRequest>()
      yield* Effect.forkScoped(session.serve(Stream.fromQueue(queue)))
      return { session, queue }
    }).pipe(Effect.provide(NodeFileSystem.layer), Scope.extend(scope))
  )
  let channel = 1
  const proxy = await startConnectProxy({
    openTunnel: (host, port) => {
      const tunnel = inMemoryTunnel(channel++, host, port)
      Queue.unsafeOffer(session.queue, tunnel.request)
      return tunnel.result
    }
  })
  const agentOptions = { keepAlive: true, maxSockets: 1 }
  return {
    direct: new https.Agent({ ...agentOptions, ca: [upstream.caPem], servername: NAME }),
    brokered: new ProxyAgent(proxy.port, {
      ...agentOptions,
      ca: [mode === "terminate" ? session.session.caCertPem : upstream.caPem]
    }),
    port: upstream.port,
    close: async () => {
      await proxy.close()
      await Effect.runPromise(Scope.close(scope, Exit.void))
      await upstream.close()
    }
  }
}

const get = (agent: https.Agent, port: number, pathname: string) =>
  new Promise<number>((resolve, reject) => {
    const req = https.request(
      {
        agent,
        host: agent instanceof ProxyAgent ? NAME : "127.0.0.1",
        port,
        path: pathname,
        headers: { host: `${NAME}:${port}` },
        servername: NAME
      },
      (res: http.IncomingMessage) => {
        let bytes = 0
        res.on("data", (c: Buffer) => (bytes += c.length))
        res.on("end", () =>
          res.statusCode === 200 ? resolve(bytes) : reject(new Error(`status ${res.statusCode}`))
        )
        res.on("error", reject)
      }
    )
    req.on("error", reject)
    req.end()
  })

const timed = async (f: () => Promise<unknown>) => {
  const start = performance.now()
  await f()
  return performance.now() - start
}

/** 100 MB download, broker vs direct: ratio of times (goal ≤ 1.25, i.e. ≥ 0.8× throughput) */
export const brokerDownload = async (
  ctx: BenchContext,
  mode: "terminate" | "passthrough" = "terminate"
): Promise<Figure> => {
  const rig = await makeRig(ctx.tmp, mode)
  try {
    const runs = Math.max(1, Math.min(ctx.runs, 3))
    const once = (agent: https.Agent) =>
      timed(async () => {
        const bytes = await get(agent, rig.port, `/bytes?n=${DOWNLOAD_BYTES}`)
        if (bytes !== DOWNLOAD_BYTES) throw new Error(`short download: ${bytes}`)
      })
    await once(rig.direct)
    await once(rig.brokered)
    const a: Array<number> = []
    const b: Array<number> = []
    for (let i = 0; i < runs; i++) {
      a.push(await once(rig.brokered))
      b.push(await once(rig.direct))
    }
    const brokered = median(a)
    const direct = median(b)
    const mbps = (ms: number) => round(DOWNLOAD_BYTES / 1024 / 1024 / (ms / 1000), 1)
    return {
      ratio: round(brokered / direct),
      medianMs: round(brokered, 1),
      floorMs: round(direct, 1),
      runs,
      goal: 1.25,
      note: `100 MiB, ${mode} mode: ${mbps(brokered)} MiB/s via broker vs ${mbps(direct)} MiB/s direct (throughput ${round(direct / brokered)}×, goal ≥ 0.8×)`
    }
  } finally {
    await rig.close()
  }
}

/** the same download through a host without a credential rule (TCP pass-through) */
export const brokerDownloadPassthrough = (ctx: BenchContext): Promise<Figure> =>
  brokerDownload(ctx, "passthrough")

/** 1,000 small keep-alive requests, broker vs direct: per-request ms (goal ≤ +2 ms) */
export const brokerRequests = async (ctx: BenchContext): Promise<Figure> => {
  const rig = await makeRig(ctx.tmp)
  try {
    const runs = Math.max(1, Math.min(ctx.runs, 3))
    const batch = (agent: https.Agent) =>
      timed(async () => {
        for (let i = 0; i < SMALL_REQUESTS; i++) await get(agent, rig.port, "/hello")
      })
    await batch(rig.direct)
    await batch(rig.brokered)
    const a: Array<number> = []
    const b: Array<number> = []
    for (let i = 0; i < runs; i++) {
      a.push((await batch(rig.brokered)) / SMALL_REQUESTS)
      b.push((await batch(rig.direct)) / SMALL_REQUESTS)
    }
    const brokered = median(a)
    const direct = median(b)
    // first request on a fresh tunnel: CONNECT + both TLS handshakes + upstream connect
    const fresh = await timed(() =>
      get(
        new ProxyAgent((rig.brokered as ProxyAgent)["proxyPort"], { ca: rig.brokered.options.ca! }),
        rig.port,
        "/hello"
      )
    )
    return {
      ratio: round(brokered / direct),
      medianMs: round(brokered, 3),
      floorMs: round(direct, 3),
      runs,
      note: `${SMALL_REQUESTS} sequential requests on one keep-alive connection: +${round(brokered - direct, 3)} ms per request (goal ≤ +2 ms); a fresh tunnel's first request ${round(fresh, 1)} ms`
    }
  } finally {
    await rig.close()
  }
}
