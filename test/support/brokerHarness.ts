/**
 * Host-side harness for the broker: an in-memory tunnel pair standing in for a protocol v4
 * channel, a TunnelRequest built on it, and an HTTPS upstream on 127.0.0.1 with its own CA.
 */
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import * as https from "node:https"
import type * as net from "node:net"
import { Duplex } from "node:stream"
import * as zlib from "node:zlib"
import type { TunnelOpenResult } from "../../src/guest/connectProxy.js"
import { makeSessionCa } from "../../src/broker/ca.js"
import { GuestDisconnected, type TunnelRequest } from "../../src/services/GuestRpc.js"

/** Two connected in-memory Duplex ends with backpressure; `end()` on one is EOF on the other. */
export const duplexPair = (): [Duplex, Duplex] => {
  const sides: Array<Duplex> = []
  const pending: Array<(() => void) | undefined> = [undefined, undefined]
  const make = (self: number): Duplex => {
    const other = 1 - self
    return new Duplex({
      allowHalfOpen: false,
      read() {
        // the other side may write again
        const wake = pending[other]
        pending[other] = undefined
        wake?.()
      },
      write(chunk: Buffer, _encoding, callback) {
        const peer = sides[other]!
        if (peer.destroyed) return callback(new Error("peer closed"))
        if (peer.push(chunk)) callback()
        else pending[self] = () => callback()
      },
      final(callback) {
        const peer = sides[other]!
        if (!peer.destroyed) peer.push(null)
        callback()
      },
      destroy(error, callback) {
        const peer = sides[other]!
        if (!peer.destroyed && !peer.readableEnded) peer.push(null)
        const wake = pending[self]
        pending[self] = undefined
        wake?.()
        callback(error)
      }
    })
  }
  sides.push(make(0), make(1))
  return [sides[0]!, sides[1]!]
}

/**
 * A TunnelRequest whose channel is an in-memory pair: `result` settles with the guest end of
 * the pair when the broker accepts, or with its reason when it denies.
 */
export const inMemoryTunnel = (channel: number, host: string, port: number) => {
  const [guestSide, hostSide] = duplexPair()
  let settle: (result: TunnelOpenResult) => void = () => undefined
  const result = new Promise<TunnelOpenResult>((resolve) => {
    settle = resolve
  })
  const request: TunnelRequest = {
    channel,
    host,
    port,
    accept: () =>
      Effect.sync(() => {
        settle({ ok: true, stream: guestSide })
        return {
          read: Stream.fromAsyncIterable(
            hostSide as AsyncIterable<Buffer>,
            () => new GuestDisconnected({ message: "tunnel channel closed" })
          ),
          write: (chunk: Uint8Array) =>
            Effect.async<void, GuestDisconnected>((resume) => {
              hostSide.write(chunk, (error) =>
                resume(
                  error
                    ? Effect.fail(new GuestDisconnected({ message: "tunnel channel closed" }))
                    : Effect.void
                )
              )
            }),
          close: Effect.sync(() => {
            hostSide.end()
          })
        }
      }),
    deny: (reason: string) => Effect.sync(() => settle({ ok: false, reason }))
  }
  return { request, result }
}

export interface UpstreamRequest {
  readonly method: string
  readonly url: string
  readonly headers: Readonly<Record<string, string | ReadonlyArray<string> | undefined>>
  /** the request body as received so far (latin1) */
  body: string
  /** which upstream connection carried it (the client's port) */
  readonly connection: number
}

/**
 * An HTTPS server on 127.0.0.1 for `name`, with a certificate from its own test CA, keep-alive,
 * answering whatever Host a request names (virtual hosts: a smuggled request for another name is
 * recorded under that name). Routes: `/hello` → "hello from upstream"; `/bytes?n=N` → N bytes;
 * `…/reflect` → the request's headers echoed back (below); `…/sse` → an event stream echoing
 * them, one event now, the next when `releaseSse()` is called; anything else → 404. Records every
 * request (headers and body) for assertions.
 *
 * `/reflect` is a server that echoes request headers, as a hostile or careless upstream would:
 * the header values in the body (JSON) and in response headers (`x-reflect-<name>`), the
 * `x-api-key` value in the status message too. `?encoding=gzip|br|deflate|<other>` codes the
 * body that way whatever the request's Accept-Encoding; `?split=N` writes the body N bytes per
 * write, each on its own turn of the event loop (chunk boundaries inside the secret);
 * `?chunked=1` sends no Content-Length.
 */
export const startUpstream = async (name: string) => {
  const ca = await makeSessionCa({ commonName: "abox test upstream CA" })
  const leaf = ca.leaf(name)
  const seen: Array<UpstreamRequest> = []
  const sseWaiting: Array<() => void> = []
  const chunk = Buffer.alloc(64 * 1024, 0x61)
  const server = https.createServer({ cert: leaf.certPem, key: leaf.keyPem, keepAlive: true }, (req, res) => {
    const record: UpstreamRequest = {
      method: req.method ?? "",
      url: req.url ?? "",
      headers: { ...req.headers },
      body: "",
      connection: req.socket.remotePort ?? 0
    }
    seen.push(record)
    const url = new URL(req.url ?? "/", "https://upstream")
    req.on("data", (chunk: Buffer) => (record.body += chunk.toString("latin1")))
    if (url.pathname.endsWith("/reflect")) {
      const reflected = Object.fromEntries(
        Object.entries(req.headers).filter(([name]) => name === "x-api-key" || name === "authorization")
      )
      const raw = Buffer.from(`${JSON.stringify({ headers: req.headers, reflected })}\n`, "utf8")
      const encoding = url.searchParams.get("encoding")
      const body =
        encoding === "gzip"
          ? zlib.gzipSync(raw)
          : encoding === "br"
            ? zlib.brotliCompressSync(raw)
            : encoding === "deflate"
              ? zlib.deflateSync(raw)
              : raw
      const headers: Record<string, string> = { "content-type": "application/json" }
      for (const [name, value] of Object.entries(reflected)) headers[`x-reflect-${name}`] = String(value)
      if (encoding !== null) headers["content-encoding"] = encoding
      if (url.searchParams.get("chunked") === null) headers["content-length"] = String(body.length)
      const key = req.headers["x-api-key"]
      res.writeHead(200, typeof key === "string" ? `OK ${key}` : "OK", headers)
      const split = Number(url.searchParams.get("split") ?? "0")
      if (split <= 0) return void res.end(body)
      let at = 0
      const next = () => {
        if (at >= body.length) return void res.end()
        res.write(body.subarray(at, at + split))
        at += split
        setImmediate(next)
      }
      next()
    } else if (url.pathname.endsWith("/sse")) {
      res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" })
      const event = (n: number) =>
        `event: echo\ndata: ${JSON.stringify({ n, key: req.headers["x-api-key"] ?? null })}\n\n`
      res.write(event(1))
      sseWaiting.push(() => {
        res.write(event(2))
        res.end()
      })
    } else if (url.pathname === "/hello") {
      res.writeHead(200, { "content-type": "text/plain" })
      res.end("hello from upstream\n")
    } else if (url.pathname === "/bytes") {
      let left = Number(url.searchParams.get("n") ?? "0")
      res.writeHead(200, { "content-type": "application/octet-stream", "content-length": String(left) })
      const pump = () => {
        while (left > 0) {
          const n = Math.min(left, chunk.length)
          left -= n
          if (!res.write(n === chunk.length ? chunk : chunk.subarray(0, n)))
            return void res.once("drain", pump)
        }
        res.end()
      }
      pump()
    } else {
      res.writeHead(404)
      res.end()
    }
  })
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", () => resolve()))
  const port = (server.address() as net.AddressInfo).port
  return {
    port,
    caPem: ca.certPem,
    seen,
    /** the open `/sse` streams send their second event and end */
    releaseSse: () => {
      for (const send of sseWaiting.splice(0)) send()
    },
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections()
        server.close(() => resolve())
      })
  }
}

/** Open a CONNECT tunnel through the proxy; resolves with the socket after the 200, or the refusal. */
export const connectThroughProxy = (proxyPort: number, target: string) =>
  new Promise<{ ok: true; socket: net.Socket } | { ok: false; status: number; head: string }>(
    (resolve, reject) => {
      import("node:net").then(({ connect }) => {
        const socket = connect({ host: "127.0.0.1", port: proxyPort })
        let buffered = Buffer.alloc(0)
        socket.on("error", reject)
        socket.on("connect", () => socket.write(`CONNECT ${target} HTTP/1.1\r\nHost: ${target}\r\n\r\n`))
        const onData = (chunk: Buffer) => {
          buffered = Buffer.concat([buffered, chunk])
          const end = buffered.indexOf("\r\n\r\n")
          if (end < 0) return
          socket.off("data", onData)
          const head = buffered.subarray(0, end).toString("latin1")
          const status = Number(head.split(" ")[1])
          if (status === 200) {
            socket.pause()
            const rest = buffered.subarray(end + 4)
            if (rest.length > 0) socket.unshift(rest)
            resolve({ ok: true, socket })
          } else {
            socket.destroy()
            resolve({ ok: false, status, head })
          }
        }
        socket.on("data", onData)
      }, reject)
    }
  )

/**
 * The first bytes node's TLS client sends for `servername` (undefined: no SNI): a real
 * ClientHello, captured on an in-memory pair and never answered.
 */
export const clientHelloBytes = async (servername: string | undefined): Promise<Buffer> => {
  const tls = await import("node:tls")
  const [a, b] = duplexPair()
  const first = new Promise<Buffer>((resolve) => b.once("data", (chunk: Buffer) => resolve(chunk)))
  const socket = tls.connect({ socket: a, servername: servername ?? "", rejectUnauthorized: false })
  socket.on("error", () => undefined)
  const bytes = await first
  socket.destroy()
  b.destroy()
  return bytes
}
