/**
 * The broker through the whole lifecycle (FakeVmm: the real guest agent, its CONNECT proxy and
 * the protocol; a real curl in a turn): the upstream sees the host's credential, the guest only a
 * placeholder; after open → turns → close → resume, a planted canary secret appears in no file of
 * the session, in no guest environment and on no VMM command line.
 */
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Stream from "effect/Stream"
import { execFileSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import * as FakeVmm from "../src/layers/FakeVmm.js"
import { httpsBrokerLayer } from "../src/broker/HttpsBrokerLive.js"
import type { BrokerPolicy } from "../src/broker/policy.js"
import { open, resume } from "../src/programs/session.js"
import type { TurnEvent } from "../src/services/GuestRpc.js"
import { startUpstream } from "./support/brokerHarness.js"
import { fakeLifecycle } from "./support/fakeLifecycle.js"

const hasCurl = (() => {
  try {
    execFileSync("curl", ["--version"], { stdio: "ignore" })
    return true
  } catch {
    return false
  }
})()

const stdoutOf = (events: ReadonlyArray<TurnEvent>) =>
  events.map((e) => (e._tag === "Event" && e.event.kind === "stdout" ? e.event.data : "")).join("")

/** every file under `dir`, recursively (the session directory, the fake guest's disk included) */
const allFiles = (dir: string): Array<string> =>
  fs.readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const full = path.join(dir, entry.name)
    if (entry.isDirectory()) return allFiles(full)
    return entry.isFile() ? [full] : []
  })

describe.skipIf(!hasCurl)("the broker through a session (FakeVmm, curl in a turn)", () => {
  if (!hasCurl)
    console.warn("curl is missing: the lifecycle broker test is skipped (scripts/setup.sh installs it)")

  it.live("credential injected on the host, placeholder in the guest, canary nowhere in the session", () =>
    Effect.gen(function* () {
      const canary = `sk-ant-canary-${Math.random().toString(36).slice(2)}-4f1e`
      process.env.ABOX_TEST_CANARY_KEY = canary
      const upstream = yield* Effect.acquireRelease(
        Effect.promise(() => startUpstream("api.test.local")),
        (u) => Effect.promise(() => u.close())
      )
      const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-broker-home-"))
      const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-broker-src-"))
      fs.writeFileSync(path.join(source, "README.md"), "hi\n")
      const policy: BrokerPolicy = {
        format: 1,
        allow: [{ host: "api.test.local", ports: [upstream.port] }],
        credentials: [{ host: "api.test.local", header: "x-api-key", fromEnv: "ABOX_TEST_CANARY_KEY" }],
        resolve: { "api.test.local": "127.0.0.1" }
      }
      // argv of every process the fake VMM starts, to check for the canary
      const argvSeen: Array<ReadonlyArray<string>> = []
      const vmm = FakeVmm.layerWith({
        command: (_spec, argv) => {
          argvSeen.push(argv)
          return argv
        }
      }).pipe(Layer.provide(NodeFileSystem.layer))
      const layer = fakeLifecycle(home, { vmm, broker: httpsBrokerLayer({ extraUpstreamCa: [upstream.caPem] }) })

      const url = `https://api.test.local:${upstream.port}/hello`
      const curl = `curl -sS --max-time 20 -H "x-api-key: $ABOX_TEST_CANARY_KEY" ${url}`
      const program = Effect.gen(function* () {
        const id = yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* open({ source, policy })
            const env = stdoutOf(Array.from(yield* Stream.runCollect(session.turn("env"))))
            expect(env).toContain("ABOX_TEST_CANARY_KEY=abox-placeholder")
            expect(env).not.toContain(canary)
            const fetched = Array.from(yield* Stream.runCollect(session.turn(curl)))
            expect(stdoutOf(fetched)).toBe("hello from upstream\n")
            // a host not in the policy is refused by the broker
            const denied = Array.from(
              yield* Stream.runCollect(
                session.turn("curl -sS --max-time 10 https://example.com/ 2>&1; echo exit=$?")
              )
            )
            expect(stdoutOf(denied)).toMatch(/exit=(56|7|35)/)
            return session.id
          })
        )
        yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* resume(id)
            const again = Array.from(yield* Stream.runCollect(session.turn(curl)))
            expect(stdoutOf(again)).toBe("hello from upstream\n")
          })
        )
        return id
      })
      const id = yield* program.pipe(Effect.provide(layer))

      // the upstream saw the real key, twice (open and resume), and never the placeholder
      const keys = upstream.seen.map((r) => r.headers["x-api-key"])
      expect(keys).toEqual([canary, canary])
      // nothing of the session holds the canary: files (config disks, logs, the guest's disk), argv
      const sessionDir = path.join(home, "sessions", id)
      const files = allFiles(sessionDir)
      expect(files.map((f) => path.basename(f))).toEqual(
        expect.arrayContaining(["config.raw", "guest-config.json", "broker.log", "session.json"])
      )
      for (const file of files) expect(fs.readFileSync(file).includes(canary), file).toBe(false)
      expect(argvSeen.length).toBe(2)
      for (const argv of argvSeen) expect(argv.join(" ")).not.toContain(canary)
      const log = fs.readFileSync(path.join(sessionDir, "broker.log"), "utf8")
      expect(log).toContain('"credential":true')
      expect(log).toContain("example.com")
      delete process.env.ABOX_TEST_CANARY_KEY
    }).pipe(Effect.scoped)
  )
})
