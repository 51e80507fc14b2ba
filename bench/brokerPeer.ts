/**
 * The broker benchmark's other side, in a worker thread: what the broker talks to in real use
 * lives outside its process (the client and the guest's CONNECT proxy in the VM, the server
 * remote). Here: the HTTPS server, the guest CONNECT proxy, and the client, which downloads
 * either directly from the server (the floor) or through the proxy, whose tunnels are channels
 * to the broker on the main thread (a loopback connection per tunnel standing in for a protocol
 * channel over the VM's socket). The same client and server serve both paths.
 */
import type * as http from "node:http"
import * as https from "node:https"
import * as net from "node:net"
import { performance } from "node:perf_hooks"
import type { Duplex } from "node:stream"
import * as tls from "node:tls"
import { parentPort, workerData } from "node:worker_threads"
import { startConnectProxy, type TunnelOpenResult } from "../src/guest/connectProxy.js"
import { startUpstream } from "../test/support/brokerHarness.js"
import { readHead } from "./socketHead.js"

/** main → peer */
export type ToPeer =
  | { readonly type: "start"; readonly brokerCaPem: string; readonly channelPort: number }
  | { readonly type: "run"; readonly job: Job; readonly seq: number }
  | { readonly type: "close" }

/** peer → main */
export type FromPeer =
  | { readonly type: "upstream"; readonly port: number; readonly caPem: string }
  | { readonly type: "ready" }
  | {
      readonly type: "done"
      readonly seq: number
      readonly ms: number
      /** CPU time of the whole process (every thread) during the job */
      readonly cpuMs: number
      readonly error?: string
    }

export type Job =
  | { readonly kind: "download"; readonly via: "direct" | "broker"; readonly bytes: number }
  | { readonly kind: "requests"; readonly via: "direct" | "broker"; readonly count: number }
  | { readonly kind: "fresh" }

const NAME = "bench.local"

const port = parentPort!
const mode = (workerData as { mode: "terminate" | "passthrough" }).mode
const send = (message: FromPeer) => port.postMessage(message)

/**
 * A tunnel: one connection to the main thread's channel listener (standing in for a protocol
 * channel over the VM's socket). The first line asks for `host port`; the answer is `ok` or
 * `deny <reason>`, then the tunnel's bytes.
 */
let channelPort = 0
const openTunnel = (host: string, tunnelPort: number) =>
  new Promise<TunnelOpenResult>((resolve) => {
    const socket = net.connect({ host: "127.0.0.1", port: channelPort })
    socket.setNoDelay(true)
    socket.once("error", () => resolve({ ok: false, reason: "channel failed" }))
    socket.write(`${host} ${tunnelPort}\n`)
    readHead(socket, "\n", (answer) => {
      if (answer === "ok") resolve({ ok: true, stream: socket })
      else {
        socket.destroy()
        resolve({ ok: false, reason: answer.replace(/^deny /, "") })
      }
    })
  })

const upstream = await startUpstream(NAME)
const proxy = await startConnectProxy({ openTunnel })

/** an https.Agent whose connections are CONNECT tunnels through the proxy */
class ProxyAgent extends https.Agent {
  override createConnection(
    options: tls.ConnectionOptions & { host?: string; port?: number },
    callback: (error: Error | null, socket?: Duplex) => void
  ) {
    const socket = net.connect({ host: "127.0.0.1", port: proxy.port })
    socket.once("connect", () =>
      socket.write(`CONNECT ${options.host}:${options.port} HTTP/1.1\r\nHost: ${options.host}\r\n\r\n`)
    )
    socket.once("error", (error) => callback(error))
    readHead(socket, "\r\n\r\n", (head) => {
      if (!head.startsWith("HTTP/1.1 200")) return callback(new Error(head))
      callback(null, tls.connect({ ...options, socket, servername: NAME }))
    })
    return undefined as unknown as Duplex
  }
}

const agentOptions = { keepAlive: true, maxSockets: 1 }
const direct = new https.Agent({ ...agentOptions, ca: [upstream.caPem], servername: NAME })
let brokered: ProxyAgent | undefined
let brokeredCa: Array<string> = []

const get = (agent: https.Agent, pathname: string) =>
  new Promise<number>((resolve, reject) => {
    const req = https.request(
      {
        agent,
        host: agent instanceof ProxyAgent ? NAME : "127.0.0.1",
        port: upstream.port,
        path: pathname,
        headers: { host: `${NAME}:${upstream.port}` },
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

const runJob = async (job: Job): Promise<{ ms: number; cpuMs: number }> => {
  const start = performance.now()
  const cpu = process.cpuUsage()
  if (job.kind === "download") {
    const bytes = await get(job.via === "direct" ? direct : brokered!, `/bytes?n=${job.bytes}`)
    if (bytes !== job.bytes) throw new Error(`short download: ${bytes}`)
  } else if (job.kind === "requests") {
    for (let i = 0; i < job.count; i++) await get(job.via === "direct" ? direct : brokered!, "/hello")
  } else {
    // first request on a fresh tunnel: CONNECT + both TLS handshakes + upstream connect
    await get(new ProxyAgent({ ca: brokeredCa }), "/hello")
  }
  const used = process.cpuUsage(cpu)
  return { ms: performance.now() - start, cpuMs: (used.user + used.system) / 1000 }
}

port.on("message", (message: ToPeer) => {
  switch (message.type) {
    case "start":
      channelPort = message.channelPort
      brokeredCa = [mode === "terminate" ? message.brokerCaPem : upstream.caPem]
      brokered = new ProxyAgent({ ...agentOptions, ca: brokeredCa })
      return send({ type: "ready" })
    case "run":
      return void runJob(message.job).then(
        ({ cpuMs, ms }) => send({ type: "done", seq: message.seq, ms, cpuMs }),
        (error: unknown) => send({ type: "done", seq: message.seq, ms: 0, cpuMs: 0, error: String(error) })
      )
    case "close":
      direct.destroy()
      brokered?.destroy()
      return void Promise.all([proxy.close(), upstream.close()]).then(() => port.close())
  }
})

send({ type: "upstream", port: upstream.port, caPem: upstream.caPem })
