/**
 * The guest's local CONNECT proxy: the agent's processes reach HTTPS through it (HTTPS_PROXY),
 * and each CONNECT becomes a broker tunnel to the host (protocol v4 `tunnel_open`). It runs on
 * every boot, so it is plain node:net with no dependencies. It never decides anything: the host's
 * broker allows or denies, and this proxy answers 200 or 403 with the host's reason.
 */
import * as net from "node:net"
import type { Duplex } from "node:stream"

export type TunnelOpenResult =
  { readonly ok: true; readonly stream: Duplex } | { readonly ok: false; readonly reason: string }

export interface ConnectProxyOptions {
  /** listen address (default 127.0.0.1: only the guest's own processes) */
  readonly host?: string
  /** 0 (default) picks a free port */
  readonly port?: number
  /** ask the host for a tunnel; resolve with the channel's byte stream or the host's reason */
  readonly openTunnel: (host: string, port: number) => Promise<TunnelOpenResult>
  /** bound on the CONNECT request head (default 8 KiB) */
  readonly maxHeadBytes?: number
  /** bound on receiving the CONNECT request head (default 10 s) */
  readonly headTimeoutMs?: number
}

export interface ConnectProxy {
  readonly port: number
  /** stop listening and destroy open connections */
  readonly close: () => Promise<void>
}

/**
 * The environment the guest agent sets for every process it starts, so that HTTPS goes through
 * the proxy and trusts the session CA. `caBundlePath`: the system CAs plus the session CA (for
 * OpenSSL- and GnuTLS-based tools, which read one file); `sessionCaPath`: the session CA alone
 * (Node adds it to its own roots). Each ordinary client's own spelling is set as well: npm's
 * (`npm_config_*`), pip's (`PIP_*`), git's `http.proxy` (through `GIT_CONFIG_*`); GNU wget reads
 * its CA from a wgetrc (`WGETRC`, written by the agent).
 */
export const guestProxyEnv = (options: {
  readonly port: number
  readonly caBundlePath: string
  readonly sessionCaPath: string
}): Record<string, string> => {
  const url = `http://127.0.0.1:${options.port}`
  return {
    HTTPS_PROXY: url,
    https_proxy: url,
    HTTP_PROXY: url,
    http_proxy: url,
    ALL_PROXY: url,
    all_proxy: url,
    NO_PROXY: "localhost,127.0.0.1,::1",
    no_proxy: "localhost,127.0.0.1,::1",
    npm_config_https_proxy: url,
    npm_config_proxy: url,
    PIP_PROXY: url,
    GIT_CONFIG_COUNT: "1",
    GIT_CONFIG_KEY_0: "http.proxy",
    GIT_CONFIG_VALUE_0: url,
    NODE_EXTRA_CA_CERTS: options.sessionCaPath,
    // Node ≥ 24 honours the proxy variables (fetch, the global http agents) only with this set
    NODE_USE_ENV_PROXY: "1",
    SSL_CERT_FILE: options.caBundlePath,
    CURL_CA_BUNDLE: options.caBundlePath,
    REQUESTS_CA_BUNDLE: options.caBundlePath,
    GIT_SSL_CAINFO: options.caBundlePath,
    PIP_CERT: options.caBundlePath,
    npm_config_cafile: options.caBundlePath,
    AWS_CA_BUNDLE: options.caBundlePath,
    DENO_CERT: options.caBundlePath
  }
}

/** the refusal's reason, fit for a status line and a header: printable ASCII, bounded */
const printable = (reason: string) => reason.replace(/[^\x20-\x7e]/g, "?").slice(0, 200)

/**
 * A refusal every client can show: the reason is in the status line (what curl -v, GNU wget,
 * git and Python print for a failed CONNECT), in `X-Abox-Deny-Reason` and in the body (what a
 * plain-HTTP client prints).
 */
const reply = (socket: net.Socket, status: number, text: string, reason?: string) => {
  const line = reason === undefined ? text : `${text} (abox: ${printable(reason)})`
  const body = `${line}\n`
  const extra = reason === undefined ? "" : `X-Abox-Deny-Reason: ${printable(reason)}\r\n`
  socket.end(
    `HTTP/1.1 ${status} ${line}\r\n${extra}Content-Type: text/plain\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`
  )
}

/** `host:port` or `[v6]:port` of a CONNECT target; the host string is passed on as written. */
const parseTarget = (target: string): { host: string; port: number } | undefined => {
  const match = /^(\[[^\]]*\]|[^:[\]]+):(\d{1,5})$/.exec(target)
  if (match === null) return undefined
  const port = Number(match[2])
  if (port < 1 || port > 65535) return undefined
  return { host: match[1]!, port }
}

const HEAD_END = Buffer.from("\r\n\r\n")

const handleConnection = (socket: net.Socket, options: ConnectProxyOptions) => {
  const maxHead = options.maxHeadBytes ?? 8192
  let buffered = Buffer.alloc(0)
  socket.setNoDelay(true)
  socket.on("error", () => socket.destroy())
  const timer = setTimeout(() => reply(socket, 408, "Request Timeout"), options.headTimeoutMs ?? 10_000)
  socket.once("close", () => clearTimeout(timer))

  const onData = (chunk: Buffer) => {
    buffered = Buffer.concat([buffered, chunk])
    const end = buffered.indexOf(HEAD_END)
    if (end < 0) {
      if (buffered.length > maxHead) {
        socket.off("data", onData)
        clearTimeout(timer)
        reply(socket, 431, "Request Header Fields Too Large")
      }
      return
    }
    socket.off("data", onData)
    socket.pause()
    clearTimeout(timer)
    if (end > maxHead) return reply(socket, 431, "Request Header Fields Too Large")
    const head = buffered.subarray(0, end).toString("latin1")
    const rest = buffered.subarray(end + HEAD_END.length)
    const [method, target, version] = (head.split("\r\n")[0] ?? "").split(" ")
    if (version === undefined || !/^HTTP\/1\.[01]$/.test(version)) {
      return reply(socket, 400, "Bad Request", "not an HTTP/1.x request")
    }
    // a plain-HTTP request through the proxy (`GET http://host/ HTTP/1.1`): refused like a denied
    // host, with the reason, so that the client reports it instead of failing obscurely
    if (method !== "CONNECT") {
      return reply(socket, 403, "Forbidden", "plain-http-not-brokered: only HTTPS (CONNECT) leaves the guest")
    }
    const parsed = parseTarget(target ?? "")
    if (parsed === undefined) return reply(socket, 400, "Bad Request", "bad CONNECT target")
    options.openTunnel(parsed.host, parsed.port).then(
      (result) => {
        if (socket.destroyed) {
          if (result.ok) result.stream.destroy()
          return
        }
        if (!result.ok) return reply(socket, 403, "Forbidden", result.reason)
        const stream = result.stream
        socket.write("HTTP/1.1 200 Connection Established\r\n\r\n")
        if (rest.length > 0) stream.write(rest)
        stream.on("error", () => socket.destroy())
        socket.on("close", () => stream.destroy())
        stream.on("close", () => socket.destroy())
        socket.pipe(stream)
        stream.pipe(socket)
        socket.resume()
      },
      () => reply(socket, 502, "Bad Gateway", "tunnel failed")
    )
  }
  socket.on("data", onData)
}

export const startConnectProxy = (options: ConnectProxyOptions): Promise<ConnectProxy> =>
  new Promise((resolve, reject) => {
    const sockets = new Set<net.Socket>()
    const server = net.createServer((socket) => {
      sockets.add(socket)
      socket.once("close", () => sockets.delete(socket))
      handleConnection(socket, options)
    })
    server.once("error", reject)
    server.listen(options.port ?? 0, options.host ?? "127.0.0.1", () => {
      server.off("error", reject)
      const address = server.address() as net.AddressInfo
      resolve({
        port: address.port,
        close: () =>
          new Promise<void>((done) => {
            for (const socket of sockets) socket.destroy()
            server.close(() => done())
          })
      })
    })
  })
