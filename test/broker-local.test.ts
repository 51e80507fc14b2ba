/**
 * The broker's two ways past its defaults for a host's own network, over real sockets (CONNECT
 * proxy → in-memory tunnel → HttpsBroker), no VM:
 * - a `localHttp` rule (what the lifecycle adds for a keyless model server on the host's
 *   loopback): plain HTTP under the endpoint's path reaches exactly that address and port;
 *   other paths, other ports, other loopback names and addresses stay refused;
 * - `guestCaFiles`: checked when the session is made (certificates only), handed to the guest.
 */
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as FileSystem from "@effect/platform/FileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Queue from "effect/Queue"
import type * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as crypto from "node:crypto"
import * as http from "node:http"
import type * as net from "node:net"
import * as path from "node:path"
import { makeHttpsBroker } from "../src/broker/HttpsBrokerLive.js"
import { makeSessionCa } from "../src/broker/ca.js"
import { checkCaPem } from "../src/broker/caFiles.js"
import { readBrokerLog } from "../src/broker/log.js"
import { type BrokerPolicyEncoded, decodePolicy } from "../src/broker/policy.js"
import { pathUnder } from "../src/broker/terminate.js"
import { startConnectProxy } from "../src/guest/connectProxy.js"
import { LOCAL_MODEL_HOST } from "../src/lib/models.js"
import type { TunnelRequest } from "../src/services/GuestRpc.js"
import { connectThroughProxy, inMemoryTunnel } from "./support/brokerHarness.js"

interface Seen {
  readonly method: string
  readonly url: string
  readonly headers: http.IncomingHttpHeaders
}

/** a plain-HTTP server on 127.0.0.1 that records every request and answers `ok <port>` */
const startPlain = async () => {
  const seen: Array<Seen> = []
  const server = http.createServer((req, res) => {
    seen.push({ method: req.method ?? "", url: req.url ?? "", headers: { ...req.headers } })
    req.resume()
    res.writeHead(200, { "content-type": "text/plain" })
    res.end(`ok ${(server.address() as net.AddressInfo).port}\n`)
  })
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", () => resolve()))
  return {
    port: (server.address() as net.AddressInfo).port,
    seen,
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections()
        server.close(() => resolve())
      })
  }
}

const setup = (policyFor: (dir: string) => BrokerPolicyEncoded) =>
  Effect.gen(function* () {
    const fs = yield* FileSystem.FileSystem
    const dir = yield* fs.makeTempDirectoryScoped({ prefix: "abox-broker-local-" })
    const sessionDir = path.join(dir, "session")
    yield* fs.makeDirectory(sessionDir, { mode: 0o700 })
    const policy = yield* decodePolicy(policyFor(dir))
    const broker = yield* makeHttpsBroker()
    const session = yield* broker.make(policy, { sessionId: "s-local", sessionDir })
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
          }
        })
      ),
      (p) => Effect.promise(() => p.close())
    )
    return { session, proxy }
  })

/** one tunnel, one raw request (Connection: close), everything the broker answered */
const exchange = (proxyPort: number, target: string, request: string) =>
  Effect.promise(async () => {
    const opened = await connectThroughProxy(proxyPort, target)
    if (!opened.ok) return `refused ${opened.status} ${opened.head.split("\r\n")[0]}`
    const socket = opened.socket
    return await new Promise<string>((resolve) => {
      let text = ""
      socket.on("data", (c: Buffer) => (text += c.toString("latin1")))
      socket.on("error", () => resolve(text))
      socket.on("close", () => resolve(text))
      socket.resume()
      socket.write(request)
    })
  })

const scoped = <A, E>(effect: Effect.Effect<A, E, FileSystem.FileSystem | Scope.Scope>) =>
  effect.pipe(Effect.scoped, Effect.provide(NodeFileSystem.layer))

const statusOf = (answer: string) => answer.split("\r\n")[0]

describe("a localHttp endpoint on the host's loopback (real sockets)", () => {
  it.live("requests under its path reach exactly that server; every other loopback target is refused", () =>
    scoped(
      Effect.gen(function* () {
        const model = yield* Effect.acquireRelease(
          Effect.promise(() => startPlain()),
          (s) => Effect.promise(() => s.close())
        )
        const other = yield* Effect.acquireRelease(
          Effect.promise(() => startPlain()),
          (s) => Effect.promise(() => s.close())
        )
        const { session, proxy } = yield* setup(() => ({
          format: 1,
          allow: [],
          localHttp: [
            { host: LOCAL_MODEL_HOST, port: model.port, endpoint: `http://127.0.0.1:${model.port}/v1` }
          ]
        }))
        const target = `${LOCAL_MODEL_HOST}:${model.port}`
        const request = (line: string, host = target, extra = "") =>
          `${line} HTTP/1.1\r\nHost: ${host}\r\nAuthorization: Bearer abox-placeholder\r\n${extra}Content-Length: 2\r\nConnection: close\r\n\r\n{}`

        const ok = yield* exchange(proxy.port, target, request("POST /v1/chat/completions"))
        expect(statusOf(ok)).toBe("HTTP/1.1 200 OK")
        expect(ok).toContain(`ok ${model.port}`)
        expect(model.seen).toHaveLength(1)
        expect(model.seen[0]).toMatchObject({ method: "POST", url: "/v1/chat/completions" })
        // the Host a client on the host sends; the placeholder never reaches the server
        expect(model.seen[0]!.headers["host"]).toBe(`127.0.0.1:${model.port}`)
        expect(model.seen[0]!.headers["authorization"]).toBeUndefined()
        const models = yield* exchange(proxy.port, target, request("GET /v1/models"))
        expect(statusOf(models)).toBe("HTTP/1.1 200 OK")

        // attacks through the allowed tunnel: another path of the same server, traversal in
        // every spelling, an absolute-form target naming another port, a Host for another port
        const refusedInside: Array<[string, string]> = []
        for (const [name, raw] of [
          ["outside the path", request("POST /api/pull")],
          ["prefix without boundary", request("GET /v1evil")],
          ["dot segments", request("GET /v1/../api/pull")],
          ["encoded dots", request("GET /v1/%2e%2e/api/pull")],
          ["encoded slash", request("GET /v1%2f..%2fapi/pull")],
          ["backslash", request("GET /v1/..\\api/pull")],
          ["double slash", request("GET /v1//api/pull")],
          ["absolute form", request(`GET http://127.0.0.1:${other.port}/v1/models`)],
          ["Host of another port", request("GET /v1/models", `127.0.0.1:${other.port}`)],
          ["Host of another name", request("GET /v1/models", `localhost:${model.port}`)]
        ] as const) {
          refusedInside.push([name, statusOf(yield* exchange(proxy.port, target, raw))!])
        }
        expect(refusedInside).toEqual([
          ["outside the path", "HTTP/1.1 403 Forbidden"],
          ["prefix without boundary", "HTTP/1.1 403 Forbidden"],
          ["dot segments", "HTTP/1.1 403 Forbidden"],
          ["encoded dots", "HTTP/1.1 403 Forbidden"],
          ["encoded slash", "HTTP/1.1 403 Forbidden"],
          ["backslash", "HTTP/1.1 403 Forbidden"],
          ["double slash", "HTTP/1.1 403 Forbidden"],
          ["absolute form", "HTTP/1.1 400 Bad Request"],
          ["Host of another port", "HTTP/1.1 421 Misdirected Request"],
          ["Host of another name", "HTTP/1.1 421 Misdirected Request"]
        ])
        expect(model.seen).toHaveLength(2)

        // a second loopback port, by every name: refused before any byte goes anywhere
        const tunnels: Array<[string, string]> = []
        for (const t of [
          `${LOCAL_MODEL_HOST}:${other.port}`,
          `127.0.0.1:${other.port}`,
          `localhost:${other.port}`,
          `[::1]:${other.port}`,
          `127.0.0.1:${model.port}`,
          `localhost:${model.port}`
        ]) {
          tunnels.push([t, yield* exchange(proxy.port, t, request("GET /v1/models", t))])
        }
        expect(tunnels).toEqual([
          [`${LOCAL_MODEL_HOST}:${other.port}`, expect.stringContaining("refused 403") as string],
          [`127.0.0.1:${other.port}`, expect.stringContaining("refused 403") as string],
          [`localhost:${other.port}`, expect.stringContaining("refused 403") as string],
          [`[::1]:${other.port}`, expect.stringContaining("refused 403") as string],
          [`127.0.0.1:${model.port}`, expect.stringContaining("refused 403") as string],
          [`localhost:${model.port}`, expect.stringContaining("refused 403") as string]
        ])
        expect(other.seen).toHaveLength(0)
        expect(model.seen).toHaveLength(2)
        // TLS to the local name is not a way around it: the bytes are not an HTTP request
        const tlsTry = yield* exchange(proxy.port, target, "\x16\x03\x01\x00\x05hello")
        expect(statusOf(tlsTry)).toBe("HTTP/1.1 400 Bad Request")
        expect(model.seen).toHaveLength(2)

        const entries = (yield* readBrokerLog(session.logPath)).entries
        const opens = entries.filter((e) => e.event === "open")
        expect(opens.find((e) => e.decision === "allow")).toMatchObject({
          host: LOCAL_MODEL_HOST,
          mode: "local-http",
          address: "127.0.0.1"
        })
        expect(opens.filter((e) => e.decision === "deny").map((e) => e.reason)).toEqual([
          "port-not-allowed",
          "ip-literal",
          "host-not-allowed",
          "ip-literal",
          "ip-literal",
          "host-not-allowed"
        ])
        // (identical denials past five are counted, not logged: docs/broker.md)
        expect(
          entries.filter((e) => e.event === "request" && e.decision === "deny").map((e) => e.reason)
        ).toEqual(
          expect.arrayContaining(["path-not-allowed", "not-origin-form", "bad-request", "host-mismatch"])
        )
      })
    )
  )

  it("pathUnder: the prefix on a segment boundary, no traversal however spelt", () => {
    expect(pathUnder("/v1", "/v1")).toBe(true)
    expect(pathUnder("/v1/chat/completions?stream=true", "/v1")).toBe(true)
    expect(pathUnder("/anything", "")).toBe(true)
    for (const bad of [
      "/v1x",
      "/v2/x",
      "/v1/../x",
      "/v1/./x",
      "/v1/%2E%2E/x",
      "/v1%2fx",
      "/v1/%5cx",
      "/v1\\x",
      "/v1//x",
      "v1/x",
      "*"
    ])
      expect([bad, pathUnder(bad, "/v1")]).toEqual([bad, false])
    expect(pathUnder("/../etc", "")).toBe(false)
  })

  it.effect("the policy refuses a localHttp endpoint that is not plain HTTP on loopback", () =>
    Effect.gen(function* () {
      for (const endpoint of [
        "https://127.0.0.1:11434/v1",
        "http://10.0.0.5:11434/v1",
        "http://127.0.0.1.evil.example:11434/v1",
        "http://user@127.0.0.1:11434/v1",
        "http://127.0.0.1:11434/v1?x=1",
        "http://127.0.0.1:11434/v1/../api",
        "http://[::ffff:127.0.0.1]:11434/v1",
        "http://127.0.0.1:99999/v1"
      ]) {
        const exit = yield* Effect.exit(
          decodePolicy({
            format: 1,
            allow: [],
            localHttp: [{ host: LOCAL_MODEL_HOST, port: 11434, endpoint }]
          })
        )
        expect([endpoint, Exit.isFailure(exit)]).toEqual([endpoint, true])
      }
    })
  )
})

describe("guestCaFiles (checked on the host)", () => {
  it.live(
    "certificates only reach the guest config; a key, a non-PEM or a missing file stops the session naming it",
    () =>
      scoped(
        Effect.gen(function* () {
          const fs = yield* FileSystem.FileSystem
          const dir = yield* fs.makeTempDirectoryScoped({ prefix: "abox-guest-ca-" })
          const corp = yield* Effect.promise(() =>
            makeSessionCa({ commonName: "Example Corp Inspection CA" })
          )
          const good = path.join(dir, "corp.pem")
          // a bundle as distributions write them: comments around the block
          yield* fs.writeFileString(good, `# Example Corp\n${corp.certPem}\n# end\n`)
          const { session } = yield* setup(() => ({ format: 1, allow: [], guestCaFiles: [good] }))
          expect(session.guestCaPems).toHaveLength(1)
          expect(session.guestCaPems[0]).toMatch(
            /^-----BEGIN CERTIFICATE-----\n[\s\S]+-----END CERTIFICATE-----\n$/
          )
          expect(session.guestCaPems[0]).not.toContain("Example Corp\n")
          expect(new crypto.X509Certificate(session.guestCaPems[0]!).subject).toContain(
            "Example Corp Inspection CA"
          )

          const { privateKey } = crypto.generateKeyPairSync("ec", { namedCurve: "P-256" })
          const keyPem = privateKey.export({ type: "pkcs8", format: "pem" }).toString()
          const cases: Array<[string, string | undefined]> = [
            ["with-key.pem", `${corp.certPem}${keyPem}`],
            ["not-pem.txt", "just some text\n"],
            ["broken.pem", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"],
            ["unclosed.pem", `${corp.certPem}-----BEGIN CERTIFICATE-----\nMIIB\n`],
            ["missing.pem", undefined]
          ]
          for (const [name, content] of cases) {
            const file = path.join(dir, name)
            if (content !== undefined) yield* fs.writeFileString(file, content)
            const made = yield* Effect.exit(
              setup(() => ({ format: 1, allow: [], guestCaFiles: [good, file] })).pipe(Effect.scoped)
            )
            expect(Exit.isFailure(made)).toBe(true)
            if (Exit.isFailure(made)) {
              const error = made.cause._tag === "Fail" ? made.cause.error : undefined
              expect(error).toMatchObject({ _tag: "BrokerError", reason: "ca" })
              expect((error as { message: string }).message).toContain(file)
              // the key's bytes are in no message
              expect((error as { message: string }).message).not.toContain("PRIVATE KEY-----\nMI")
            }
          }
        })
      )
  )

  it("checkCaPem: every block a certificate", () => {
    expect(checkCaPem("").ok).toBe(false)
    expect(checkCaPem("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")).toEqual({
      ok: false,
      reason: "it holds a PRIVATE KEY block, not only certificates"
    })
  })
})
