import * as FileSystem from "@effect/platform/FileSystem"
import * as Cause from "effect/Cause"
import * as Clock from "effect/Clock"
import * as Config from "effect/Config"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FiberSet from "effect/FiberSet"
import * as Layer from "effect/Layer"
import * as Redacted from "effect/Redacted"
import * as Ref from "effect/Ref"
import * as Stream from "effect/Stream"
import * as dns from "node:dns"
import * as net from "node:net"
import * as path from "node:path"
import { describeParseError } from "../lib/parseErrors.js"
import type { Duplex } from "node:stream"
import * as tls from "node:tls"
import { makeSessionCa } from "./ca.js"
import { expandHome, readCaFile } from "./caFiles.js"
import { channelDuplex, type TunnelChannel } from "./channel.js"
import { readClientHello } from "./clientHello.js"
import { BROKER_LOG_FILE, type BrokerLogEntry, type BrokerLogOptions, openBrokerLog } from "./log.js"
import {
  type BrokerPolicy,
  checkResolved,
  credentialHeaderValue,
  credentialOutside,
  type CredentialRule,
  decide,
  decodePolicyJson
} from "./policy.js"
import { type CredentialValue, type RequestRecord, terminateTunnel } from "./terminate.js"
import type { TunnelRequest } from "../services/GuestRpc.js"
import {
  BrokerError,
  BrokerPolicyError,
  type BrokerSession,
  TunnelFailed,
  type BrokerSessionInfo,
  HttpsBroker,
  type HttpsBrokerShape
} from "../services/HttpsBroker.js"

export interface HttpsBrokerOptions {
  /** name → addresses; default: the system resolver (all addresses). Tests inject their own. */
  readonly resolve?: (host: string) => Promise<ReadonlyArray<string>>
  /** open a TCP connection to exactly this address; default node:net. Tests inject their own. */
  readonly dial?: (address: string, port: number) => Promise<Duplex>
  /** test only: extra CAs trusted upstream, on top of the system's */
  readonly extraUpstreamCa?: ReadonlyArray<string>
  /** concurrent tunnels per session (default 64); more are denied */
  readonly maxTunnels?: number
  /** request head bound in terminate mode (default 64 KiB); larger heads get 431 */
  readonly maxHeaderBytes?: number
  /** bound on a TLS handshake and on each request head (default 30 s) */
  readonly headTimeout?: Duration.DurationInput
  /** a tunnel silent this long is closed (default 10 min) */
  readonly idleTimeout?: Duration.DurationInput
  /** bound on name resolution plus the TCP connect (default 10 s) */
  readonly dialTimeout?: Duration.DurationInput
  /** broker.log's bounds: queue, rotation, field lengths, denial rate limit */
  readonly log?: BrokerLogOptions
}

const defaultResolve = async (host: string): Promise<ReadonlyArray<string>> => {
  const answers = await dns.promises.lookup(host, { all: true, verbatim: true })
  return answers.map((a) => a.address)
}

const defaultDial = (address: string, port: number): Promise<Duplex> =>
  new Promise((resolve, reject) => {
    const socket = net.connect({ host: address, port })
    socket.once("connect", () => {
      socket.off("error", reject)
      resolve(socket)
    })
    socket.once("error", reject)
  })

const errorCode = (cause: unknown): string => {
  const code = (cause as { code?: unknown } | undefined)?.code
  return typeof code === "string" ? code.toLowerCase() : "error"
}

/** a dial that, once interrupted (timeout, scope closed), destroys a connection that comes late */
const dialCancellable = (dial: () => Promise<Duplex>) =>
  Effect.async<Duplex, string>((resume) => {
    let cancelled = false
    dial().then(
      (socket) => {
        // an upstream reset before the tunnel's own listeners are on must not be an uncaught
        // error of the host process; the socket's close that follows ends the tunnel
        socket.on("error", () => undefined)
        return cancelled ? socket.destroy() : resume(Effect.succeed(socket))
      },
      (cause) => resume(Effect.fail(errorCode(cause)))
    )
    return Effect.sync(() => {
      cancelled = true
    })
  })

const MAX_SECRET_FILE = 64 * 1024

/** one tunnel's bookkeeping for its "close" line */
interface TunnelState {
  closeReason: string | undefined
  /** requests on this tunnel that carried the credential upstream */
  injected: number
  counted: { readonly bytesUp: () => number; readonly bytesDown: () => number } | undefined
}

/** where an accepted tunnel goes: the upstream already connected (passthrough), or termination */
interface TunnelRoute {
  readonly state: TunnelState
  readonly host: string
  readonly port: number
  readonly upstream: Duplex | undefined
  readonly terminate:
    | {
        /** absent: a `localHttp` endpoint (plain HTTP, no credential) */
        readonly rule: CredentialRule | undefined
        readonly plain: { readonly hostHeader: string; readonly pathPrefix: string } | undefined
        readonly dial: () => Promise<Duplex>
        readonly onRequest: (record: RequestRecord) => void
        readonly onDeny: (reason: string) => void
      }
    | undefined
  readonly logDenied: (reason: string) => Effect.Effect<void>
}

/** the close line's reason: the tunnel's own, the session closing, or the broker failing */
const closeReason = (state: TunnelState, exit: Exit.Exit<unknown, unknown>): { reason?: string } => {
  if (state.closeReason !== undefined) return { reason: state.closeReason }
  if (Exit.isSuccess(exit)) return {}
  if (Cause.isInterruptedOnly(exit.cause)) return { reason: "session-closed" }
  const failure = Cause.failureOption(exit.cause)
  return {
    reason:
      failure._tag === "Some" && failure.value instanceof TunnelFailed
        ? `broker-failed:${failure.value.reason}`
        : "broker-failed"
  }
}

/** the header value for a rule and a secret, and the forms of the secret it carries */
const credentialValueFor = (rule: CredentialRule, secret: string): CredentialValue => {
  const value = credentialHeaderValue(rule, secret)
  return {
    value,
    secrets: rule.basicUser === undefined ? [secret] : [secret, value.slice("Basic ".length)]
  }
}

export const makeHttpsBroker = (options: HttpsBrokerOptions = {}) =>
  Effect.gen(function* () {
    const fs = yield* FileSystem.FileSystem
    const resolveName = options.resolve ?? defaultResolve
    const dialAddress = options.dial ?? defaultDial
    const maxTunnels = options.maxTunnels ?? 64
    const maxHeaderBytes = options.maxHeaderBytes ?? 64 * 1024
    const headTimeoutMs = Duration.toMillis(options.headTimeout ?? "30 seconds")
    const idleTimeoutMs = Duration.toMillis(options.idleTimeout ?? "10 minutes")
    const dialTimeout = options.dialTimeout ?? "10 seconds"

    /**
     * the header value for a rule, read now (never cached, never logged), with the secrets it is
     * made of (the secret; for basic auth also its base64 form); undefined when unavailable
     */
    const readCredential = (rule: CredentialRule): Effect.Effect<CredentialValue | undefined> => {
      const raw: Effect.Effect<string | undefined> =
        "fromEnv" in rule
          ? Config.redacted(rule.fromEnv).pipe(
              Effect.map((value) => Redacted.value(value)),
              Effect.orElseSucceed(() => undefined)
            )
          : fs.stat(expandHome(rule.fromFile)).pipe(
              Effect.filterOrFail((info) => info.type === "File" && Number(info.size) <= MAX_SECRET_FILE),
              Effect.zipRight(fs.readFileString(expandHome(rule.fromFile))),
              Effect.map((text) => text.replace(/\r?\n$/, "")),
              Effect.orElseSucceed(() => undefined)
            )
      return raw.pipe(
        Effect.map((secret) =>
          secret === undefined || secret === "" || /[\r\n]/.test(secret)
            ? undefined
            : credentialValueFor(rule, secret)
        )
      )
    }

    /** the host's NODE_EXTRA_CA_CERTS, which node drops as soon as a `ca` list is given */
    const hostExtraCas = Effect.gen(function* () {
      const file = process.env["NODE_EXTRA_CA_CERTS"]
      if (file === undefined || file === "") return []
      return yield* fs.readFileString(file).pipe(
        Effect.map((pem) => [pem]),
        Effect.catchAll((error) =>
          Effect.as(Effect.logWarning(`NODE_EXTRA_CA_CERTS ${file} unreadable`, error.message), [])
        )
      )
    })

    const make = Effect.fn("HttpsBroker.make")(function* (policy: BrokerPolicy, session: BrokerSessionInfo) {
      const ca = yield* Effect.tryPromise({
        try: () => makeSessionCa({ commonName: `abox session ${session.sessionId}` }),
        catch: (cause) =>
          new BrokerError({ reason: "ca", message: `could not make the session CA: ${String(cause)}` })
      })
      // CAs trusted upstream: the system's (which for node include NODE_EXTRA_CA_CERTS) unless the
      // policy or the caller adds some; then the list is spelled out, the host's extra CAs kept
      const policyCas = yield* Effect.forEach(policy.upstreamCaFiles ?? [], (file) =>
        fs.readFileString(expandHome(file)).pipe(
          Effect.filterOrFail(
            (pem) => pem.includes("-----BEGIN CERTIFICATE-----"),
            () => new Error("no PEM certificate in it")
          ),
          Effect.mapError(
            (cause) =>
              new BrokerError({
                reason: "ca",
                message: `cannot read the upstream CA file ${file} (policy upstreamCaFiles): ${cause.message}`
              })
          )
        )
      )
      // CAs for the guest's trust store (a TLS-inspecting network): certificates only, checked here
      const guestCaPems = yield* Effect.forEach(policy.guestCaFiles ?? [], (file) =>
        readCaFile(file).pipe(
          Effect.provideService(FileSystem.FileSystem, fs),
          Effect.map((checked) => checked.pems),
          Effect.mapError(
            (reason) =>
              new BrokerError({
                reason: "ca",
                message: `the guest CA file ${file} (policy guestCaFiles) is not usable: ${reason}`
              })
          )
        )
      ).pipe(Effect.map((lists) => lists.flat()))
      const extraCas = [...(options.extraUpstreamCa ?? []), ...policyCas]
      const upstreamCa =
        extraCas.length === 0 ? undefined : [...tls.rootCertificates, ...(yield* hostExtraCas), ...extraCas]
      // parsed once per session, not per upstream connection
      const upstreamContext =
        upstreamCa === undefined
          ? undefined
          : yield* Effect.try({
              try: () => tls.createSecureContext({ ca: upstreamCa }),
              catch: (cause) =>
                new BrokerError({ reason: "ca", message: `the upstream CAs do not load: ${String(cause)}` })
            })
      const logPath = path.join(session.sessionDir, BROKER_LOG_FILE)
      const brokerLog = yield* openBrokerLog(logPath, options.log).pipe(
        Effect.provideService(FileSystem.FileSystem, fs),
        Effect.mapError(
          (cause) =>
            new BrokerError({ reason: "log", message: `could not open ${logPath}: ${cause.message}` })
        )
      )
      const contexts = new Map<string, tls.SecureContext>()
      const contextFor = (host: string) => {
        let context = contexts.get(host)
        if (context === undefined) {
          const leaf = ca.leaf(host)
          context = tls.createSecureContext({ cert: leaf.certPem, key: leaf.keyPem })
          contexts.set(host, context)
        }
        return context
      }
      const turn = yield* Ref.make<number | undefined>(undefined)
      const active = yield* Ref.make(0)
      const fibers = yield* FiberSet.make()
      const clock = yield* Effect.clock
      const isoNow = () => new Date(clock.unsafeCurrentTimeMillis()).toISOString()

      const writeLog = brokerLog.write
      const log = (entry: Omit<BrokerLogEntry, "time" | "turn">) =>
        Ref.get(turn).pipe(
          Effect.flatMap((t) =>
            writeLog({ time: isoNow(), ...(t === undefined ? {} : { turn: t }), ...entry })
          )
        )

      const serveTunnel = Effect.fn("HttpsBroker.serveTunnel")(function* (request: TunnelRequest) {
        const started = yield* Clock.currentTimeMillis
        // every line of a tunnel carries the turn it was opened in
        const openedIn = yield* Ref.get(turn)
        const stamp = (entry: Omit<BrokerLogEntry, "time" | "turn">): BrokerLogEntry => ({
          time: isoNow(),
          ...(openedIn === undefined ? {} : { turn: openedIn }),
          ...entry
        })
        const log = (entry: Omit<BrokerLogEntry, "time" | "turn">) => writeLog(stamp(entry))
        const enqueue = (entry: Omit<BrokerLogEntry, "time" | "turn">) => brokerLog.enqueue(stamp(entry))
        const base = { channel: request.channel, host: request.host, port: request.port }
        const refuse = (reason: string) =>
          Effect.zipRight(
            request.deny(reason),
            log({ ...base, event: "open", decision: "deny", reason, credential: false })
          )

        const decision = decide(policy, request.host, request.port)
        if (!decision.allow) return yield* refuse(decision.reason)

        // resolve once, check, and dial exactly the checked address (no second lookup)
        let address: string
        let dialPort = request.port
        if (decision.local !== undefined) {
          // the catalog's (or policy's) loopback endpoint: that address and port, nothing else
          address = decision.local.address
          dialPort = decision.local.port
        } else if (decision.pinned !== undefined) {
          address = decision.pinned.address
          dialPort = decision.pinned.port ?? request.port
        } else {
          const answer = yield* Effect.tryPromise(() => resolveName(decision.host)).pipe(
            Effect.timeout(dialTimeout),
            Effect.either
          )
          if (answer._tag === "Left") return yield* refuse("resolve-failed")
          const checked = checkResolved(answer.right)
          if (!checked.ok) return yield* refuse(checked.reason)
          address = checked.address
        }
        const dial = () => dialAddress(address, dialPort)
        const mode =
          decision.local !== undefined
            ? ("local-http" as const)
            : decision.credential === undefined
              ? ("passthrough" as const)
              : ("terminate" as const)

        // passthrough: connect first, accept only once the host is reachable
        let upstream: Duplex | undefined
        if (mode === "passthrough") {
          const connected = yield* Effect.acquireRelease(
            dialCancellable(dial).pipe(
              Effect.timeoutFail({ duration: dialTimeout, onTimeout: () => "timeout" }),
              Effect.either
            ),
            (result) => Effect.sync(() => (result._tag === "Right" ? result.right.destroy() : undefined))
          )
          if (connected._tag === "Left") {
            return yield* refuse(`connect-failed:${connected.left}`)
          }
          upstream = connected.right
        }

        const state: TunnelState = { closeReason: undefined, injected: 0, counted: undefined }
        // accept and its "open" line, then (however the tunnel ends: either side, the session
        // closing, or the broker failing) the channel closed exactly once and the "close" line
        // with the totals
        const channel = yield* Effect.acquireRelease(
          request.accept().pipe(
            // closed once, whichever comes first: the channel's writer after the last byte, or this
            Effect.map((accepted): TunnelChannel => {
              let closed = false
              return {
                ...accepted,
                close: Effect.suspend(() => {
                  if (closed) return Effect.void
                  closed = true
                  return accepted.close
                })
              }
            }),
            Effect.tap(() =>
              log({ ...base, event: "open", decision: "allow", address, mode, credential: false })
            ),
            Effect.tapError(() =>
              log({
                ...base,
                event: "open",
                decision: "deny",
                reason: "guest-disconnected",
                credential: false
              })
            ),
            Effect.either
          ),
          (accepted, exit) =>
            accepted._tag === "Left"
              ? Effect.void
              : Effect.zipRight(
                  accepted.right.close,
                  Effect.flatMap(Clock.currentTimeMillis, (now) =>
                    log({
                      ...base,
                      event: "close",
                      decision: "allow",
                      ...closeReason(state, exit),
                      address,
                      mode,
                      credential: state.injected > 0,
                      bytesUp: state.counted?.bytesUp() ?? 0,
                      bytesDown: state.counted?.bytesDown() ?? 0,
                      durationMs: now - started
                    })
                  )
                )
        )
        if (channel._tag === "Left") return
        yield* serveChannel(channel.right, {
          state,
          host: decision.host,
          port: request.port,
          upstream,
          terminate:
            mode === "passthrough"
              ? undefined
              : {
                  rule: decision.credential,
                  plain:
                    decision.local === undefined
                      ? undefined
                      : { hostHeader: decision.local.hostHeader, pathPrefix: decision.local.pathPrefix },
                  dial,
                  onRequest: (record) => {
                    if (record.credential) state.injected++
                    enqueue({
                      ...base,
                      event: "request",
                      decision: record.decision,
                      ...(record.reason === undefined ? {} : { reason: record.reason }),
                      credential: record.credential,
                      method: record.method,
                      ...(record.status === undefined ? {} : { status: record.status }),
                      ...(record.droppedHeaders === undefined
                        ? {}
                        : { droppedHeaders: record.droppedHeaders }),
                      ...(record.path === undefined ? {} : { path: record.path }),
                      ...(record.redacted === undefined ? {} : { redacted: record.redacted })
                    })
                  },
                  onDeny: (reason) => {
                    state.closeReason = reason
                    enqueue({ ...base, event: "request", decision: "deny", reason, credential: false })
                  }
                },
          logDenied: (reason) =>
            log({ ...base, event: "request", decision: "deny", reason, credential: false })
        })
      })

      /**
       * The seam between the broker and the host protocol: one accepted tunnel served from its
       * channel (guest bytes in as a Stream, bytes out as a write) for as long as the Scope it
       * runs in, which is the tunnel's lifetime. Whatever supplies a (readable, writable, scope)
       * triple plugs in here as a `TunnelChannel`. Passthrough: the ClientHello checked, then
       * bytes copied both ways; terminate: TLS ended here and each request re-made upstream.
       */
      const serveChannel = Effect.fn("HttpsBroker.serveChannel")(function* (
        channel: TunnelChannel,
        route: TunnelRoute
      ) {
        const guest = yield* channelDuplex(channel)
        route.state.counted = guest
        if (route.terminate === undefined) {
          const up = route.upstream!
          // an upstream gone while the guest's ClientHello is awaited ends the guest's side too
          const upstreamGone = () => {
            route.state.closeReason = "upstream-closed"
            guest.duplex.destroy()
          }
          if (up.destroyed) return upstreamGone()
          up.once("close", upstreamGone)
          // nothing goes upstream before the ClientHello names the tunnel's host (no fronting)
          const hello = yield* Effect.tryPromise({
            try: () => readClientHello(guest.duplex, route.host, { timeoutMs: headTimeoutMs }),
            catch: (cause) => new TunnelFailed({ reason: "client-hello", message: String(cause) })
          }).pipe(Effect.ensuring(Effect.sync(() => up.off("close", upstreamGone))))
          if (up.destroyed) return upstreamGone()
          if (!hello.ok) {
            route.state.closeReason = hello.reason
            if (hello.reason !== "closed-before-hello") yield* route.logDenied(hello.reason)
            return
          }
          up.write(hello.head)
          ;(up as Partial<net.Socket>).setTimeout?.(idleTimeoutMs, () => {
            route.state.closeReason = "idle-timeout"
            up.destroy()
          })
          guest.duplex.on("error", () => up.destroy())
          up.on("error", () => guest.duplex.destroy())
          up.on("close", () => guest.duplex.destroy())
          guest.duplex.on("close", () => up.destroy())
          guest.duplex.pipe(up)
          up.pipe(guest.duplex)
          return yield* guest.closed
        }
        const { rule, plain, dial, onRequest, onDeny } = route.terminate
        yield* terminateTunnel(guest.duplex, {
          host: route.host,
          port: route.port,
          ...(plain === undefined ? { secureContext: contextFor(route.host) } : { plain }),
          ...(rule === undefined
            ? {}
            : {
                credential: {
                  header: rule.header,
                  value: readCredential(rule),
                  outside: (method: string, target: string) => {
                    const why = credentialOutside(rule, method, target)
                    return why === undefined ? undefined : `credential-not-for-${why}`
                  }
                }
              }),
          dial,
          dialTimeoutMs: Duration.toMillis(dialTimeout),
          upstreamContext,
          maxHeaderBytes,
          headTimeoutMs,
          idleTimeoutMs,
          onRequest,
          onDeny
        }).pipe(Effect.mapError((error) => new TunnelFailed({ reason: "terminate", message: error.message })))
      })

      /** takes one of the maxTunnels slots (every tunnel being decided or served holds one) */
      const admit = Ref.modify(active, (n): [boolean, number] =>
        n >= maxTunnels ? [false, n] : [true, n + 1]
      )
      // a tunnel's failure ends that tunnel only: its close line names it, and it is logged whole
      const tunnelFailed = (cause: Cause.Cause<unknown>) => Effect.logError("broker tunnel failed", cause)
      const serveAdmitted = (request: TunnelRequest): Effect.Effect<void> =>
        serveTunnel(request).pipe(
          Effect.scoped,
          Effect.catchAllCause((cause) =>
            Cause.isInterruptedOnly(cause) ? Effect.void : tunnelFailed(cause)
          ),
          Effect.ensuring(Ref.update(active, (n) => n - 1))
        )
      const refuseBusy = (request: TunnelRequest): Effect.Effect<void> =>
        Effect.zipRight(
          request.deny("too-many-tunnels"),
          log({
            channel: request.channel,
            host: request.host,
            port: request.port,
            event: "open",
            decision: "deny",
            reason: "too-many-tunnels",
            credential: false
          })
        ).pipe(Effect.catchAllCause(tunnelFailed))

      const handle = Effect.fn("HttpsBroker.handle")(function* (request: TunnelRequest) {
        const admitted = yield* admit
        yield* admitted ? serveAdmitted(request) : refuseBusy(request)
      })

      // at most maxTunnels fibers: a refusal is answered (and logged) before the next request is
      // taken, so a guest that floods tunnel_open is slowed to the pace of its refusals (back
      // pressure through the connection's bounded queue), never a fiber per request
      const serve = Effect.fn("HttpsBroker.serve")(function* (tunnels: Stream.Stream<TunnelRequest>) {
        yield* tunnels.pipe(
          Stream.runForEach((request) =>
            Effect.flatMap(admit, (admitted) =>
              admitted ? Effect.asVoid(FiberSet.run(fibers, serveAdmitted(request))) : refuseBusy(request)
            )
          )
        )
      })

      return {
        caCertPem: ca.certPem,
        guestCaPems,
        logPath,
        serve,
        handle,
        setTurn: (t: number | undefined) => Ref.set(turn, t),
        active: Ref.get(active)
      } satisfies BrokerSession
    })

    const loadPolicy = Effect.fn("HttpsBroker.loadPolicy")(function* (file: string) {
      const text = yield* fs.readFileString(file).pipe(
        Effect.mapError(
          (cause) =>
            new BrokerPolicyError({
              path: file,
              reason: "unreadable",
              message:
                cause._tag === "SystemError" && cause.reason === "NotFound"
                  ? `the broker policy file ${file} does not exist`
                  : `cannot read the broker policy file ${file}: ${cause.message}`
            })
        )
      )
      return yield* decodePolicyJson(text).pipe(
        Effect.mapError(
          (error) =>
            new BrokerPolicyError({
              path: file,
              reason: "invalid",
              message: `${file} is not a valid broker policy (docs/broker.md): ${describeParseError(error)}`
            })
        )
      )
    })

    return { make, loadPolicy } satisfies HttpsBrokerShape
  })

/** The broker with system DNS, system CAs and default bounds. Needs FileSystem. */
export const HttpsBrokerLive = Layer.effect(HttpsBroker, makeHttpsBroker())

/** The broker with injected resolver/dialer/bounds (tests, benchmarks). Needs FileSystem. */
export const httpsBrokerLayer = (options: HttpsBrokerOptions) =>
  Layer.effect(HttpsBroker, makeHttpsBroker(options))
