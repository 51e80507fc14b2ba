/**
 * TLS termination for hosts with a credential rule: the guest's TLS ends here (a leaf of the
 * session CA), each HTTP/1.1 request is forwarded over the broker's own TLS connection to the
 * real host (certificate verified), with the credential header set on the way. Node's
 * `node:https`/`node:tls` over the tunnel's Duplex, served as a scoped Effect: the credential is
 * read by a fiber of the tunnel's scope, and closing the scope tears the connection down.
 *
 * The same server, in plain HTTP on both sides (`plain`), serves a policy's `localHttp` endpoint
 * on the host's loopback: no TLS, no credential, only paths under the endpoint's path.
 */
import * as Effect from "effect/Effect"
import * as Queue from "effect/Queue"
import * as Schema from "effect/Schema"
import type * as Scope from "effect/Scope"
import * as http from "node:http"
import * as https from "node:https"
import type { Duplex, Transform } from "node:stream"
import * as tls from "node:tls"
import * as zlib from "node:zlib"
import { CREDENTIAL_PLACEHOLDER } from "../protocol/GuestConfig.js"
import { normalizeHost } from "./host.js"
import { redactText, SecretRedactor, secretNeedles } from "./redact.js"
import { errorMessage } from "../domain/errorMessage.js"

export interface RequestRecord {
  readonly method: string
  readonly status: number | undefined
  readonly decision: "allow" | "deny"
  readonly reason: string | undefined
  /** whether the credential header was sent upstream on this request */
  readonly credential: boolean
  /** headers dropped because they still carried the guest's placeholder (names, lower case) */
  readonly droppedHeaders?: ReadonlyArray<string>
  /** the request's path (before the query), any secret in it replaced */
  readonly path?: string
  /** how many times a secret was replaced with the placeholder in the response (when it was) */
  readonly redacted?: number
}

/** A credential as read for one request: the header's value and the secrets it is made of. */
export interface CredentialValue {
  readonly value: string
  /** what must never reach the guest: the secret, and any encoding of it the header carries */
  readonly secrets: ReadonlyArray<string>
}

export interface TerminateOptions {
  /** the tunnel's (normalised) host and port: SNI and Host must name this host */
  readonly host: string
  readonly port: number
  /** the leaf certificate for `host` from the session CA, as a TLS context (cached by the caller) */
  readonly secureContext?: tls.SecureContext
  /**
   * header name, a reader for its value (run per request; undefined: not available), and where it
   * applies: `outside(method, target)` says why it does not go on a request (undefined: it does);
   * none for `plain`
   */
  readonly credential?: {
    readonly header: string
    readonly value: Effect.Effect<CredentialValue | undefined>
    readonly outside: (method: string, target: string) => string | undefined
  }
  /**
   * plain HTTP on both sides instead (a `localHttp` endpoint on the host's loopback): no TLS, no
   * credential; only paths under `pathPrefix` are forwarded, with `Host: <hostHeader>`
   */
  readonly plain?: { readonly hostHeader: string; readonly pathPrefix: string }
  /** a TCP connection to the checked address (the broker resolved and checked it once) */
  readonly dial: () => Promise<Duplex>
  /** bound on dial + upstream TLS handshake */
  readonly dialTimeoutMs: number
  /** the CAs trusted upstream, as a TLS context made once per session: undefined for the system's */
  readonly upstreamContext: tls.SecureContext | undefined
  readonly maxHeaderBytes: number
  /** bound on the TLS handshake, and on each request head (from connection or last response) */
  readonly headTimeoutMs: number
  /** bound on silence once a request is under way */
  readonly idleTimeoutMs: number
  readonly onRequest: (record: RequestRecord) => void
  /** the connection was refused before any request (handshake, SNI, head too large, timeout) */
  readonly onDeny: (reason: string) => void
}

const HOP_BY_HOP = new Set([
  "connection",
  "keep-alive",
  "proxy-connection",
  "proxy-authorization",
  "proxy-authenticate",
  "te",
  "trailer",
  "transfer-encoding",
  "upgrade",
  "host"
])

const forwardHeaders = (
  raw: ReadonlyArray<string>,
  drop: ReadonlySet<string>
): Record<string, string | Array<string>> => {
  const connectionListed = new Set<string>()
  for (let i = 0; i < raw.length; i += 2) {
    if (raw[i]!.toLowerCase() === "connection") {
      for (const token of raw[i + 1]!.split(",")) connectionListed.add(token.trim().toLowerCase())
    }
  }
  const out: Record<string, string | Array<string>> = {}
  for (let i = 0; i < raw.length; i += 2) {
    const name = raw[i]!.toLowerCase()
    if (HOP_BY_HOP.has(name) || connectionListed.has(name) || drop.has(name)) continue
    const value = raw[i + 1]!
    const existing = out[name]
    out[name] =
      existing === undefined ? value : Array.isArray(existing) ? [...existing, value] : [existing, value]
  }
  return out
}

/** `host[:port]` of a Host header → normalised host and port (undefined when absent). */
const parseHostHeader = (value: string): { host: string; port: number | undefined } | undefined => {
  const match = /^([^:]+)(?::(\d{1,5}))?$/.exec(value.trim())
  if (match === null) return undefined
  const checked = normalizeHost(match[1]!)
  if (!checked.ok) return undefined
  return { host: checked.host, port: match[2] === undefined ? undefined : Number(match[2]) }
}

/**
 * Is `target` (origin-form) under `prefix` (`/v1`: `/v1` itself or `/v1/…`; "": every path), so
 * that no server, however it normalises, reads it as a path outside: no dot segments, no encoded
 * `.`, `/` or `\\`, no backslash, no empty segment.
 */
export const pathUnder = (target: string, prefix: string): boolean => {
  const pathPart = target.split("?", 1)[0]!
  if (!pathPart.startsWith("/") || pathPart.includes("\\") || /%(2e|2f|5c)/i.test(pathPart)) return false
  const segments = pathPart.slice(1).split("/")
  const dotOrEmpty = (segment: string, i: number) =>
    segment === "." || segment === ".." || (segment === "" && i < segments.length - 1)
  if (segments.some(dotOrEmpty)) return false
  return prefix === "" || pathPart === prefix || pathPart.startsWith(`${prefix}/`)
}

/** a request target that carries the placeholder, spelled plainly or percent-encoded */
const urlHasPlaceholder = (url: string): boolean => {
  if (url.includes(CREDENTIAL_PLACEHOLDER)) return true
  try {
    return decodeURIComponent(url.replaceAll("+", " ")).toLowerCase().includes(CREDENTIAL_PLACEHOLDER)
  } catch {
    return url.includes("%")
  }
}

const MAX_LOGGED_HEADERS = 8
const MAX_LOGGED_HEADER_NAME = 64
/** secrets remembered per tunnel (a secret file may change between requests) */
const MAX_REMEMBERED_SECRETS = 8

/** a decoder for one content coding, undefined for one the broker cannot decode */
const decoderFor = (coding: string): Transform | undefined => {
  switch (coding) {
    case "gzip":
    case "x-gzip":
      return zlib.createGunzip()
    case "deflate":
      return zlib.createInflate()
    case "br":
      return zlib.createBrotliDecompress()
    case "zstd": {
      // node ≥ 22.15 has it; before, a zstd body is refused
      const make = (zlib as { readonly createZstdDecompress?: () => Transform }).createZstdDecompress
      return make === undefined ? undefined : make()
    }
    default:
      return undefined
  }
}

/** whether a response to `method` with `status` has a body */
const responseHasBody = (method: string, status: number) =>
  method !== "HEAD" && status !== 204 && status !== 304 && !(status >= 100 && status < 200)

const plainResponse = (status: number, text: string) =>
  `HTTP/1.1 ${status} ${http.STATUS_CODES[status] ?? ""}\r\nContent-Type: text/plain\r\nContent-Length: ${Buffer.byteLength(text) + 1}\r\nConnection: close\r\n\r\n${text}\n`

/** The termination could not be set up for a tunnel (node refused the server or agent options). */
export class TerminateFailed extends Schema.TaggedError<TerminateFailed>()("TerminateFailed", {
  message: Schema.String
}) {}

/**
 * Serve one tunnel in terminate mode, in the caller's scope: completes when the guest side is
 * closed, fails (typed) only when the termination cannot be set up; interrupted (the scope
 * closing), it destroys the guest side, the server and the upstream connections. The credential
 * value goes only into the upstream request's header; it is never logged, echoed, or put in an
 * error.
 */
export const terminateTunnel = (
  guest: Duplex,
  options: TerminateOptions
): Effect.Effect<void, TerminateFailed, Scope.Scope> =>
  Effect.gen(function* () {
    // node asks for the credential per request; a fiber of this scope reads it and answers
    const asks = yield* Queue.unbounded<(value: CredentialValue | undefined) => void>()
    const reader = options.credential?.value
    if (reader !== undefined)
      yield* Queue.take(asks).pipe(
        Effect.flatMap((answer) => Effect.map(reader, answer)),
        Effect.forever,
        Effect.forkScoped
      )
    const credential = () =>
      new Promise<CredentialValue | undefined>((answer) => Queue.unsafeOffer(asks, answer))
    yield* Effect.acquireRelease(
      Effect.try({
        try: () => startTermination(guest, options, credential),
        catch: (cause) => new TerminateFailed({ message: errorMessage(cause) })
      }),
      (stop) => Effect.sync(stop)
    )
    yield* Effect.async<void>((resume) => {
      if (guest.destroyed || guest.closed) return resume(Effect.void)
      const done = () => resume(Effect.void)
      guest.once("close", done)
      return Effect.sync(() => guest.off("close", done))
    })
  })

/** node's side of a terminated tunnel, started at once; returns its teardown */
const startTermination = (
  guest: Duplex,
  options: TerminateOptions,
  credentialValue: () => Promise<CredentialValue | undefined>
): (() => void) => {
  {
    const secureContext = options.secureContext
    const upstreamContext = options.upstreamContext
    const plain = options.plain
    const credentialHeader = options.credential?.header.toLowerCase()
    // every secret this tunnel's requests were sent with, kept out of every later response too
    const remembered: Array<string> = []
    const remember = (secrets: ReadonlyArray<string>) => {
      for (const secret of secrets) {
        if (remembered.includes(secret)) continue
        remembered.push(secret)
        if (remembered.length > MAX_REMEMBERED_SECRETS) remembered.shift()
      }
    }
    let denied = false
    const deny = (reason: string) => {
      if (denied) return
      denied = true
      options.onDeny(reason)
    }

    // the broker's own connections upstream: keep-alive, always to the checked address
    const agent = new http.Agent({ keepAlive: true, maxSockets: 4 })
    agent.createConnection = ((_: unknown, callback: (error: Error | null, socket?: Duplex) => void) => {
      let timedOut = false
      let handedOver: tls.TLSSocket | undefined
      const timer = setTimeout(() => {
        timedOut = true
        const error = Object.assign(new Error("upstream connect timed out"), { code: "ETIMEDOUT" })
        // after the hand-over the request sees the socket's error; before it, the callback's
        if (handedOver !== undefined) handedOver.destroy(error)
        else callback(error)
      }, options.dialTimeoutMs)
      options.dial().then(
        (raw) => {
          if (timedOut) return void raw.destroy()
          if (plain !== undefined) {
            clearTimeout(timer)
            return void callback(null, raw)
          }
          const secure = tls.connect({
            socket: raw,
            servername: options.host,
            ...(upstreamContext === undefined ? {} : { secureContext: upstreamContext }),
            ALPNProtocols: ["http/1.1"]
          })
          const done = () => clearTimeout(timer)
          secure.once("secureConnect", done)
          secure.once("error", done)
          secure.once("close", done)
          handedOver = secure
          callback(null, secure)
        },
        (error: Error) => {
          clearTimeout(timer)
          if (!timedOut) callback(error)
        }
      )
      return undefined
    }) as unknown as typeof agent.createConnection

    const server =
      plain !== undefined
        ? http.createServer({ maxHeaderSize: options.maxHeaderBytes, keepAlive: true })
        : https.createServer({
            SNICallback: (servername, callback) => {
              const sni = normalizeHost(servername)
              if (sni.ok && sni.host === options.host) return callback(null, secureContext)
              deny("sni-mismatch")
              callback(new Error("SNI does not name the tunnel's host"))
            },
            maxHeaderSize: options.maxHeaderBytes,
            handshakeTimeout: options.headTimeoutMs,
            ALPNProtocols: ["http/1.1"],
            keepAlive: true
          })
    server.setTimeout(options.idleTimeoutMs, (socket) => {
      socket.destroy()
    })

    let headTimer: ReturnType<typeof setTimeout> | undefined
    const armHeadTimer = (socket: tls.TLSSocket) => {
      clearTimeout(headTimer)
      headTimer = setTimeout(() => {
        deny("head-timeout")
        socket.destroy()
      }, options.headTimeoutMs)
    }
    const stopHeadTimer = () => clearTimeout(headTimer)

    server.on(plain !== undefined ? "connection" : "secureConnection", (socket: tls.TLSSocket) => {
      armHeadTimer(socket)
      socket.on("close", stopHeadTimer)
    })
    server.on("tlsClientError", (error: NodeJS.ErrnoException) => {
      deny(error.code === "ERR_TLS_HANDSHAKE_TIMEOUT" ? "handshake-timeout" : "tls-handshake-failed")
      guest.destroy()
    })
    server.on("clientError", (error: NodeJS.ErrnoException, socket: Duplex) => {
      const tooLarge = error.code === "HPE_HEADER_OVERFLOW"
      if (tooLarge) deny("header-too-large")
      // a parse error is a bad request; a socket error (the guest went away) is not one
      else if (error.code?.startsWith("HPE_") === true) deny("bad-request")
      if (socket.writable)
        socket.end(
          tooLarge
            ? plainResponse(431, "abox broker: request header too large")
            : plainResponse(400, "abox broker: bad request")
        )
      else socket.destroy()
    })

    server.on("request", (req: http.IncomingMessage, res: http.ServerResponse) => {
      stopHeadTimer()
      const socket = req.socket as tls.TLSSocket
      res.on("finish", () => {
        if (!socket.destroyed) armHeadTimer(socket)
      })
      const method = req.method ?? "GET"
      const target = req.url ?? ""
      const pathOf = (needles: ReadonlyArray<Buffer>) => ({
        path: redactText(target.split("?", 1)[0]!, needles).text
      })
      const refuse = (status: number, reason: string) => {
        options.onRequest({
          method,
          status,
          decision: "deny",
          reason,
          credential: false,
          ...pathOf(secretNeedles(remembered))
        })
        res.writeHead(status, { "content-type": "text/plain", connection: "close" })
        res.end(`abox broker: ${reason}\n`)
      }
      const sni = typeof socket.servername === "string" ? normalizeHost(socket.servername) : undefined
      if (plain === undefined && (sni === undefined || !sni.ok || sni.host !== options.host))
        return refuse(421, "sni-mismatch")
      const hostHeader = req.headers.host === undefined ? undefined : parseHostHeader(req.headers.host)
      if (hostHeader === undefined || hostHeader.host !== options.host) return refuse(421, "host-mismatch")
      if (hostHeader.port !== undefined && hostHeader.port !== options.port)
        return refuse(421, "host-port-mismatch")
      if (!(req.url ?? "").startsWith("/")) return refuse(400, "not-origin-form")
      if (req.headers.upgrade !== undefined) return refuse(501, "upgrade-not-supported")
      if (plain !== undefined && !pathUnder(req.url!, plain.pathPrefix))
        return refuse(403, "path-not-allowed")

      if (urlHasPlaceholder(req.url ?? "")) return refuse(400, "placeholder-in-url")
      // framing: a body is forwarded with the framing it came with (Content-Length as is, chunked
      // re-chunked by node); any other transfer coding is refused rather than guessed at
      const transferEncoding = req.headers["transfer-encoding"]
      const chunked = transferEncoding !== undefined
      if (chunked && transferEncoding.trim().toLowerCase() !== "chunked")
        return refuse(501, "transfer-encoding-not-supported")
      if (chunked && req.headers["content-length"] !== undefined) return refuse(400, "bad-framing")

      // outside the rule's methods and paths the request goes up without the credential
      const outside = options.credential?.outside(method, target)
      ;(credentialHeader === undefined ? Promise.resolve(undefined) : credentialValue()).then(
        (credential) => {
          if (credentialHeader !== undefined && credential === undefined && outside === undefined)
            return refuse(502, "credential-unavailable")
          if (credential !== undefined && outside === undefined) remember(credential.secrets)
          const needles = secretNeedles([...remembered, ...(credential?.secrets ?? [])])
          const logged = pathOf(needles)
          // the guest's own value for the credential header never goes up, on any request
          const headers = forwardHeaders(
            req.rawHeaders,
            new Set(credentialHeader === undefined ? [] : [credentialHeader])
          )
          // the placeholder never leaves the host: a header still carrying it is dropped (the
          // credential header itself was dropped above, and set below when the rule applies)
          const droppedHeaders: Array<string> = []
          for (const [name, value] of Object.entries(headers)) {
            const values = Array.isArray(value) ? value : [value]
            if (values.some((v) => v.toLowerCase().includes(CREDENTIAL_PLACEHOLDER))) {
              delete headers[name]
              if (droppedHeaders.length < MAX_LOGGED_HEADERS)
                droppedHeaders.push(name.slice(0, MAX_LOGGED_HEADER_NAME))
            }
          }
          const dropped = droppedHeaders.length > 0 ? { droppedHeaders } : {}
          // a loopback server gets the Host a client on the host would send (its own name)
          headers["host"] = plain?.hostHeader ?? req.headers.host!
          if (credentialHeader !== undefined && credential !== undefined && outside === undefined)
            headers[credentialHeader] = credential.value
          if (chunked) headers["transfer-encoding"] = "chunked"
          // a response the broker must search is asked for uncoded (a coded one is decoded below)
          if (needles.length > 0) headers["accept-encoding"] = "identity"
          const upstream = http.request({
            agent,
            method,
            path: req.url,
            headers,
            host: options.host,
            port: options.port
          })
          // the credential left the host once the request had a connected upstream socket
          let sent = false
          let upstreamSocket: Duplex | undefined
          upstream.on("socket", (s: tls.TLSSocket) => {
            upstreamSocket = s
            if (credentialHeader === undefined || outside !== undefined) return
            if (!s.connecting && s.encrypted) sent = true
            else s.once("secureConnect", () => (sent = true))
          })
          // an upstream connection is reused only after a request that was framed and sent whole:
          // a response before the end of the body, or a guest that stops mid-body, closes it
          const retire = () => {
            upstreamSocket?.destroy()
            // the rest of the guest's body is read and dropped, so its next request is parsed
            req.unpipe(upstream)
            req.resume()
          }
          let status: number | undefined
          // secrets replaced in the response's head, and the body's replacer
          let redactedInHead = 0
          let redactor: SecretRedactor | undefined
          const redacted = () => {
            const n = redactedInHead + (redactor?.count ?? 0)
            return n > 0 ? { redacted: n } : {}
          }
          upstream.on("response", (upstreamRes) => {
            status = upstreamRes.statusCode ?? 502
            upstreamRes.on("end", () => {
              if (!req.complete || !upstream.writableFinished) retire()
            })
            // no secret flows back: status message, header names and values, body
            const clean = (text: string) => {
              const out = redactText(text, needles)
              redactedInHead += out.count
              return out.text
            }
            const rawHeaders = upstreamRes.rawHeaders.map((text) => clean(text))
            const statusMessage = clean(upstreamRes.statusMessage ?? "")
            const responseHeaders = forwardHeaders(rawHeaders, new Set())
            if (needles.length === 0 || !responseHasBody(method, status)) {
              res.writeHead(status, statusMessage, responseHeaders)
              upstreamRes.pipe(res)
              upstreamRes.on("error", () => res.destroy())
              return
            }
            // (an empty body is empty in any coding)
            const codings = (
              upstreamRes.headers["content-length"] === "0"
                ? ""
                : (upstreamRes.headers["content-encoding"] ?? "")
            )
              .split(",")
              .map((c) => c.trim().toLowerCase())
              .filter((c) => c !== "" && c !== "identity")
            const decoders = codings.reverse().map((coding) => decoderFor(coding))
            if (decoders.some((d) => d === undefined)) {
              // a body that cannot be searched is not passed on
              const reason = "response-encoding-not-supported"
              options.onRequest({
                method,
                status: 502,
                decision: "deny",
                reason,
                credential: sent,
                ...dropped,
                ...logged
              })
              status = undefined
              upstreamRes.resume()
              retire()
              res.writeHead(502, { "content-type": "text/plain", connection: "close" })
              res.end(`abox broker: ${reason}\n`)
              return
            }
            // the body's length changes with each replacement: it is re-framed (chunked, or
            // closed-delimited for an HTTP/1.0 guest), and sent decoded
            delete responseHeaders["content-length"]
            if (codings.length > 0) delete responseHeaders["content-encoding"]
            res.writeHead(status, statusMessage, responseHeaders)
            redactor = new SecretRedactor(needles)
            // piped, not pipeline(): pipeline would destroy the guest's response (and its socket)
            // under bytes still on their way
            const stages: ReadonlyArray<Transform> = [...(decoders as Array<Transform>), redactor]
            let from: NodeJS.ReadableStream = upstreamRes
            for (const stage of stages) {
              stage.on("error", () => res.destroy())
              from = from.pipe(stage)
            }
            from.pipe(res)
            upstreamRes.on("error", () => res.destroy())
          })
          upstream.on("error", (error: NodeJS.ErrnoException) => {
            // the guest has its whole answer: a connection retired under the rest of its body
            if (res.writableEnded) return
            // the reason is the error's code, never its message (which could quote a header)
            const reason = `upstream-${(error.code ?? "error").toLowerCase()}`
            if (!res.headersSent) {
              options.onRequest({
                method,
                status: 502,
                decision: "deny",
                reason,
                credential: sent,
                ...dropped,
                ...logged
              })
              res.writeHead(502, { "content-type": "text/plain", connection: "close" })
              res.end(`abox broker: ${reason}\n`)
            } else {
              res.destroy()
            }
            status = undefined
          })
          res.on("finish", () => {
            if (status !== undefined)
              options.onRequest({
                method,
                status,
                decision: "allow",
                credential: sent,
                ...dropped,
                ...logged,
                reason: outside,
                ...redacted()
              })
          })
          req.pipe(upstream)
          req.on("error", () => upstream.destroy())
          req.on("aborted", () => upstream.destroy())
        },
        () => refuse(502, "credential-unavailable")
      )
    })

    server.emit("connection", guest)
    return () => {
      stopHeadTimer()
      agent.destroy()
      server.close()
      if (!guest.destroyed) guest.destroy()
    }
  }
}
