/**
 * The host's own network, from a real VM (QEMU, the small test image):
 * - a network whose TLS is inspected: a pass-through host served by a loopback TLS server whose
 *   certificate chains to a CA the guest knows only from the policy's `guestCaFiles`; node in
 *   the guest verifies it with its default trust (NODE_EXTRA_CA_CERTS), the OpenSSL bundle holds
 *   it, and a host signed by another CA is still refused by the client;
 * - a keyless model server over plain HTTP on the host's loopback (a models.json entry): the
 *   model agent's turn reaches it; from a shell turn, a second loopback port and other paths of
 *   that server stay refused.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as http from "node:http"
import type * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import type { BrokerPolicy } from "../src/broker/policy.js"
import { LOCAL_MODEL_HOST } from "../src/lib/models.js"
import type { AgentEvent } from "../src/protocol/Messages.js"
import { open, type Session } from "../src/programs/session.js"
import type { TurnEvent } from "../src/services/GuestRpc.js"
import { ensureTestImage, testHome, vmSkipReason, vmSessionLayer } from "./e2e-vm-image.js"
import { startUpstream } from "./support/brokerHarness.js"
import { startModelMock } from "./support/modelMock.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e local-network VM test skipped: ${skip}`)

const eventsOf = (events: Iterable<TurnEvent>): Array<AgentEvent> =>
  Array.from(events).flatMap((e) => (e._tag === "Event" ? [e.event] : []))
const stdoutOf = (events: Iterable<TurnEvent>) =>
  eventsOf(events)
    .map((e) => (e.kind === "stdout" ? e.data : ""))
    .join("")
const collect = (session: Session, text: string, mode: "shell" | "prompt") =>
  Stream.runCollect(session.turn(text, mode)).pipe(Effect.map((c) => Chunk.toReadonlyArray(c)))

/** node in the guest: CONNECT through $HTTPS_PROXY, then TLS with node's default trust only */
const httpsGet = (host: string, port: number) =>
  `node -e '
const http = require("http"), https = require("https"), tls = require("tls")
const proxy = new URL(process.env.HTTPS_PROXY)
const req = http.request({ host: proxy.hostname, port: proxy.port, method: "CONNECT", path: "${host}:${port}" })
req.on("connect", (res, socket) => {
  if (res.statusCode !== 200) { console.log("${host} refused " + res.statusCode); process.exit(0) }
  const r = https.get({ host: "${host}", port: ${port}, path: "/hello", createConnection: () => tls.connect({ socket, servername: "${host}" }) },
    (res) => { let b = ""; res.on("data", (c) => b += c); res.on("end", () => console.log("${host} " + res.statusCode + " " + b.trim())) })
  r.on("error", (e) => console.log("${host} error " + (e.code || e.message)))
})
req.on("error", (e) => console.log("${host} error " + (e.code || e.message)))
req.end()'`

/** node in the guest: one plain-HTTP request through a CONNECT tunnel; prints the status line or the refusal */
const plainGet = (target: string, requestPath: string) =>
  `node -e '
const http = require("http")
const proxy = new URL(process.env.HTTPS_PROXY)
const req = http.request({ host: proxy.hostname, port: proxy.port, method: "CONNECT", path: "${target}" })
req.on("connect", (res, socket) => {
  if (res.statusCode !== 200) { console.log("${target}${requestPath} tunnel " + res.statusCode + " " + (res.headers["x-abox-deny-reason"] || "")); process.exit(0) }
  let b = ""
  const done = () => { console.log("${target}${requestPath} " + b.split("\\r\\n")[0]); process.exit(0) }
  socket.on("data", (c) => { b += c; if (b.includes("\\r\\n")) done() })
  socket.on("close", done)
  socket.write("GET ${requestPath} HTTP/1.1\\r\\nHost: ${target}\\r\\n\\r\\n")
})
req.on("error", (e) => console.log("${target} error " + (e.code || e.message)))
req.end()'`

const tempHome = (prefix: string) => {
  const home = fs.mkdtempSync(path.join(os.tmpdir(), prefix))
  fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
  return home
}
const tempSource = () => {
  const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-local-src-"))
  fs.writeFileSync(path.join(source, "README.md"), "local\n")
  return source
}

describe.skipIf(skip !== undefined)("the host's own network from a real VM", () => {
  it.live(
    "guestCaFiles: a pass-through host re-signed by an inspecting CA verifies in the guest; another CA does not",
    () =>
      Effect.gen(function* () {
        yield* Effect.promise(() => ensureTestImage())
        const inspected = yield* Effect.acquireRelease(
          Effect.promise(() => startUpstream("inspected.test.local")),
          (u) => Effect.promise(() => u.close())
        )
        const unknown = yield* Effect.acquireRelease(
          Effect.promise(() => startUpstream("unknown.test.local")),
          (u) => Effect.promise(() => u.close())
        )
        const home = tempHome("abox-e2e-guestca-")
        const caFile = path.join(home, "corp-ca.pem")
        fs.writeFileSync(caFile, `# the inspecting proxy's root\n${inspected.caPem}`)
        const policy: BrokerPolicy = {
          format: 1,
          allow: [
            { host: "inspected.test.local", ports: [inspected.port] },
            { host: "unknown.test.local", ports: [unknown.port] }
          ],
          credentials: [],
          resolve: { "inspected.test.local": "127.0.0.1", "unknown.test.local": "127.0.0.1" },
          guestCaFiles: [caFile]
        }
        const caLine = inspected.caPem.split(/\r?\n/)[1]!
        const out = yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* open({ source: tempSource(), policy })
            return stdoutOf(
              yield* collect(
                session,
                [
                  httpsGet("inspected.test.local", inspected.port),
                  httpsGet("unknown.test.local", unknown.port),
                  `grep -c -F '${caLine}' "$SSL_CERT_FILE" "$NODE_EXTRA_CA_CERTS"`,
                  `grep -c -- '-----BEGIN CERTIFICATE-----' "$NODE_EXTRA_CA_CERTS"`
                ].join("; "),
                "shell"
              )
            )
          })
        ).pipe(Effect.provide(vmSessionLayer(home, inspected.caPem)))
        expect(out).toContain("inspected.test.local 200 hello from upstream")
        expect(out).toMatch(
          /unknown\.test\.local error (UNABLE_TO_VERIFY_LEAF_SIGNATURE|SELF_SIGNED_CERT_IN_CHAIN)/
        )
        // the CA is in the OpenSSL bundle and in node's extra CAs (with the session CA)
        expect(out).toMatch(/ca-bundle\.pem:1\n/)
        expect(out).toMatch(/session-ca\.pem:1\n2\n/)
        // the broker passed both through (the guest's client did the refusing)
        expect(inspected.seen.map((r) => r.url)).toEqual(["/hello"])
        expect(unknown.seen).toHaveLength(0)
        // the comment around the certificate stayed on the host
        expect(out).not.toContain("inspecting proxy")
      }).pipe(Effect.scoped),
    600_000
  )

  it.live(
    "a keyless plain-HTTP model server on the host's loopback: the model turn reaches it, nothing else on loopback opens",
    () =>
      Effect.gen(function* () {
        yield* Effect.promise(() => ensureTestImage())
        const mock = yield* Effect.acquireRelease(
          Effect.promise(() => startModelMock({ plain: true })),
          (m) => Effect.promise(() => m.close())
        )
        // a second service on the host's loopback, which must stay out of reach
        const seenByOther: Array<string> = []
        const other = http.createServer((req, res) => {
          seenByOther.push(req.url ?? "")
          res.end("other\n")
        })
        yield* Effect.acquireRelease(
          Effect.promise(() => new Promise<void>((resolve) => other.listen(0, "127.0.0.1", () => resolve()))),
          () => Effect.promise(() => new Promise<void>((resolve) => other.close(() => resolve())))
        )
        const otherPort = (other.address() as net.AddressInfo).port
        const home = tempHome("abox-e2e-localmodel-")
        fs.writeFileSync(
          path.join(home, "models.json"),
          JSON.stringify({
            format: 1,
            models: {
              ollama: {
                provider: "openai",
                api: "chat",
                id: "qwen-local",
                endpoint: `http://127.0.0.1:${mock.port}/v1`,
                apiKeyEnv: null
              }
            }
          })
        )
        const policy: BrokerPolicy = { format: 1, allow: [], credentials: [], resolve: {} }
        mock.push(
          {
            kind: "tools",
            text: "Checking.",
            calls: [{ name: "shell", input: { command: "echo from-tool" } }]
          },
          { kind: "text", chunks: ["local ", "answer"] }
        )
        const { prompt, probes } = yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* open({ source: tempSource(), policy, model: "ollama" })
            const prompt = eventsOf(yield* collect(session, "say hello", "prompt"))
            const local = `${LOCAL_MODEL_HOST}:${mock.port}`
            const probes = stdoutOf(
              yield* collect(
                session,
                [
                  plainGet(local, "/v1/models"),
                  plainGet(local, "/api/pull"),
                  plainGet(local, "/v1/../api/tags"),
                  plainGet(`${LOCAL_MODEL_HOST}:${otherPort}`, "/"),
                  plainGet(`127.0.0.1:${otherPort}`, "/"),
                  plainGet(`localhost:${otherPort}`, "/"),
                  plainGet(`127.0.0.1:${mock.port}`, "/v1/models")
                ].join("; "),
                "shell"
              )
            )
            return { prompt, probes }
          })
        ).pipe(Effect.provide(vmSessionLayer(home, mock.caPem)))
        expect(prompt.filter((e) => e.kind === "tool_result").map((e) => [e.name, e.isError])).toEqual([
          ["shell", false]
        ])
        expect(
          prompt
            .filter((e) => e.kind === "text")
            .map((e) => e.delta)
            .join("")
        ).toBe("Checking.local answer")
        expect(prompt.at(-1)).toMatchObject({ kind: "agent_end", reason: "done", steps: 2 })
        const chat = mock.requests.filter((r) => r.path === "/v1/chat/completions")
        expect(chat).toHaveLength(2)
        expect(chat.map((r) => r.headers["host"])).toEqual([
          `127.0.0.1:${mock.port}`,
          `127.0.0.1:${mock.port}`
        ])
        expect(JSON.stringify(chat.map((r) => r.headers))).not.toContain("abox-placeholder")
        const local = `${LOCAL_MODEL_HOST}:${mock.port}`
        // the mock answers 404 to GET /v1/models: the request reached it
        expect(probes).toContain(`${local}/v1/models HTTP/1.1 404 Not Found`)
        // other paths of the same server: refused by the broker (the refusal closes the tunnel, and
        // the guest's proxy may drop its bytes, so the client sees a 403 or an empty reply)
        expect(probes).toMatch(new RegExp(`${local}/api/pull (HTTP/1.1 403 Forbidden)?\n`))
        expect(probes).toMatch(new RegExp(`${local}/v1/\\.\\./api/tags (HTTP/1.1 403 Forbidden)?\n`))
        expect(probes).toContain(`${LOCAL_MODEL_HOST}:${otherPort}/ tunnel 403 port-not-allowed`)
        expect(probes).toContain(`127.0.0.1:${otherPort}/ tunnel 403 ip-literal`)
        expect(probes).toContain(`localhost:${otherPort}/ tunnel 403 host-not-allowed`)
        expect(probes).toContain(`127.0.0.1:${mock.port}/v1/models tunnel 403 ip-literal`)
        expect(seenByOther).toEqual([])
        const log = fs.readFileSync(
          path.join(home, "sessions", fs.readdirSync(path.join(home, "sessions"))[0]!, "broker.log"),
          "utf8"
        )
        expect(log.match(/"reason":"path-not-allowed"/g)).toHaveLength(2)
        expect(mock.requests.map((r) => r.path)).toEqual([
          "/v1/chat/completions",
          "/v1/chat/completions",
          "/v1/models"
        ])
      }).pipe(Effect.scoped),
    600_000
  )
})
