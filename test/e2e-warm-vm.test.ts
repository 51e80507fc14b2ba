/**
 * Warm open in real VMs (QEMU, real kernel and guest agent, the busybox test image): the first
 * Open makes the image's warm snapshot (the golden booted with its agent waiting, saved), every
 * Open restores it and hands the session over the protocol; each warm session draws different
 * random bytes; the state file holds no credential or session data (planted canaries); a state
 * file that does not load makes Open boot instead and say why at debug level; the repository
 * disk is hot-plugged after the restore, and what a turn wrote after a warm open (repository
 * disk, root overlay) is there after a stop and a cold resume.
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Logger from "effect/Logger"
import * as LogLevel from "effect/LogLevel"
import * as Scope from "effect/Scope"
import * as Exit from "effect/Exit"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { HttpsBrokerLive } from "../src/broker/HttpsBrokerLive.js"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { ImagesLive } from "../src/layers/ImagesLive.js"
import { QemuVmmLive } from "../src/layers/QemuVmm.js"
import { RuntimeLockLive } from "../src/layers/RuntimeLockLive.js"
import { SessionStoreLive } from "../src/layers/SessionStoreLive.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { open, resume, type Session } from "../src/programs/session.js"
import { warmRoot } from "../src/programs/warm.js"
import { WARM_FILES } from "../src/domain/sessionLayout.js"
import type { BrokerPolicy } from "../src/broker/policy.js"
import { ensureTestImage, runTurn, testHome, vmSkipReason } from "./e2e-vm-image.js"

const layerFor = (home: string) =>
  Layer.mergeAll(
    SessionStoreLive,
    RuntimeLockLive,
    GuestRpcLive,
    HttpsBrokerLive,
    QemuVmmLive({ note: () => undefined }),
    ImagesLive
  ).pipe(
    Layer.provideMerge(aboxPathsAt(home)),
    Layer.provideMerge(NodeCommandExecutor.layer),
    Layer.provideMerge(NodeFileSystem.layer)
  )

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e-warm-vm: skipped: ${skip}`)

const CANARY_ENV = "ABOX_WARM_TEST_KEY"
const secretCanary = `sk-warm-canary-${process.pid}-${Date.now()}`
const repoCanary = `repo-warm-canary-${process.pid}-${Date.now()}`

const policy: BrokerPolicy = {
  format: 1,
  allow: [{ host: "api.example.test", ports: [443] }],
  credentials: [{ host: "api.example.test", header: "authorization", fromEnv: CANARY_ENV }],
  resolve: {}
}

/** is `needle` anywhere in the file (read in chunks, with an overlap) */
const fileHolds = (file: string, needle: string): boolean => {
  const fd = fs.openSync(file, "r")
  const chunk = Buffer.alloc(8 * 1024 * 1024)
  const overlap = needle.length
  let position = 0
  let tail = Buffer.alloc(0)
  try {
    while (true) {
      const read = fs.readSync(fd, chunk, 0, chunk.length, position)
      if (read === 0) return false
      const window = Buffer.concat([tail, chunk.subarray(0, read)])
      if (window.includes(needle)) return true
      tail = window.subarray(Math.max(0, window.length - overlap))
      position += read
    }
  } finally {
    fs.closeSync(fd)
  }
}

describe.skipIf(skip !== undefined)("warm open in real VMs", () => {
  it.live(
    "first Open makes the snapshot → two warm Opens restore it, differ in /dev/urandom → no canary in the state → a bad state boots instead (debug says why) → a warm session resumes cold",
    () => {
      const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-warm-vm-"))
      const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-warm-vm-src-"))
      fs.writeFileSync(path.join(source, "README.md"), `# warm ${repoCanary}\n`)
      const logs: Array<string> = []
      const logger = Logger.make(({ message }) => {
        logs.push(Array.isArray(message) ? message.join(" ") : String(message))
      })
      process.env[CANARY_ENV] = secretCanary
      return Effect.gen(function* () {
        const image = yield* Effect.promise(() => ensureTestImage())
        fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
        // this test makes the image's snapshot itself
        fs.rmSync(warmRoot(image), { recursive: true, force: true })

        const openIn = (name: string) =>
          Effect.gen(function* () {
            const scope = yield* Scope.make()
            const session = yield* open({ source, name, policy, helloTimeout: "90 seconds" }).pipe(
              Scope.extend(scope)
            )
            return { session, close: Scope.close(scope, Exit.void) }
          })
        const probe = (session: Session) =>
          runTurn(
            session.connection,
            "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; cat /work/repo/README.md"
          )

        const first = yield* openIn("warm-a")
        const firstOut = yield* probe(first.session)
        const keys = fs.readdirSync(warmRoot(image)).filter((entry) => !entry.startsWith("."))
        expect(keys).toHaveLength(1)
        const snapshot = path.join(warmRoot(image), keys[0]!)
        expect(logs.some((line) => line.includes("(made now)"))).toBe(true)
        const stateFile = path.join(snapshot, WARM_FILES.state)
        expect(fs.statSync(stateFile).mode & 0o777).toBe(0o600)

        logs.length = 0
        const second = yield* openIn("warm-b")
        const secondOut = yield* probe(second.session)
        expect(logs.some((line) => line.includes("restoring the warm snapshot"))).toBe(true)
        // the guest was restored and handed its session (its console says so), not booted
        const console2 = fs.readFileSync(path.join(second.session.dir, "console.log"), "utf8")
        expect(console2).toContain("session handed over")
        expect(console2).not.toContain("abox-init: started")
        // the repository came as the session's own disk, hot-plugged after the restore (no tar)
        expect(second.session.hello.repoDisk).toBe(true)
        // a turn's writes after a warm open: into the session's repository disk and root overlay
        yield* runTurn(
          second.session.connection,
          `echo kept-repo > /work/repo/after-warm.txt && echo kept-root > /home/agent/after-warm && sync`
        )

        const [random1, readme1] = firstOut.split("\n")
        const [random2, readme2] = secondOut.split("\n")
        expect(random1).toMatch(/^[0-9a-f]{64}$/)
        expect(random2).toMatch(/^[0-9a-f]{64}$/)
        expect(random1).not.toBe(random2)
        expect(readme1).toBe(`# warm ${repoCanary}`)
        expect(readme2).toBe(`# warm ${repoCanary}`)

        // no credential and nothing of a session in the warm files
        for (const file of [stateFile, path.join(snapshot, WARM_FILES.root)]) {
          expect(fileHolds(file, secretCanary)).toBe(false)
          expect(fileHolds(file, repoCanary)).toBe(false)
          expect(fileHolds(file, first.session.id)).toBe(false)
        }
        yield* first.close
        yield* second.close

        // a state file that does not load: Open boots instead and says why at debug level
        const saved = path.join(home, "state.saved")
        fs.copyFileSync(stateFile, saved)
        const fd = fs.openSync(stateFile, "r+")
        fs.writeSync(fd, Buffer.alloc(64 * 1024, 0x5a), 0, 64 * 1024, 0)
        fs.closeSync(fd)
        logs.length = 0
        const third = yield* openIn("warm-c")
        const thirdOut = yield* probe(third.session)
        expect(thirdOut.split("\n")[1]).toBe(`# warm ${repoCanary}`)
        expect(logs.some((line) => line.includes("did not restore, booting"))).toBe(true)
        yield* third.close
        fs.copyFileSync(saved, stateFile)

        // a warm session's resume boots cold from its disks, its files there
        const resumed = yield* resume("warm-b", { helloTimeout: "90 seconds" })
        const again = yield* runTurn(
          resumed.connection,
          "cat /work/repo/README.md /work/repo/after-warm.txt /home/agent/after-warm"
        )
        expect(again).toBe(`# warm ${repoCanary}\nkept-repo\nkept-root\n`)
        expect(resumed.hello.repoDisk).toBe(true)
      }).pipe(
        Effect.scoped,
        Effect.provide(layerFor(home)),
        Effect.provide(Logger.replace(Logger.defaultLogger, logger)),
        Logger.withMinimumLogLevel(LogLevel.Debug),
        Effect.ensuring(
          Effect.sync(() => {
            delete process.env[CANARY_ENV]
            fs.rmSync(home, { recursive: true, force: true })
            fs.rmSync(source, { recursive: true, force: true })
          })
        )
      )
    },
    600_000
  )
})
