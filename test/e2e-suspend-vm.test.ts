/**
 * Suspend and resume of a whole session in a real VM (QEMU under TCG, the busybox test image):
 * a loop a turn started counts on after `suspend` + `resume`; the restored guest trusts the
 * resuming process's broker CA (the old key is gone); the state holds no credential (a planted
 * canary in the host's environment, which the broker injects, is in no file of the session);
 * the state is used once (a second resume cold-boots); a state that does not fit (other -m)
 * cold-boots from the disks with the work kept.
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Logger from "effect/Logger"
import { execFileSync } from "node:child_process"
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
import { open, resume } from "../src/programs/session.js"
import { scanMemoryStates } from "../src/programs/scrubStates.js"
import { savedStateBytes, savedStateFiles } from "../src/programs/suspend.js"
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
if (skip !== undefined) console.warn(`e2e-suspend-vm: skipped: ${skip}`)

const CANARY_VAR = "ABOX_TEST_SUSPEND_CANARY"
const CANARY = "sk-canary-7f3e9d1c5b2a4f60"
/** the tail of an Anthropic-shaped key the guest assembles (the turn's text never holds it whole) */
const GUEST_SECRET_TAIL = "api03-guestMemoryOnly0123456789"
const LOOP =
  "setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done' </dev/null >/dev/null 2>&1 & sleep 0.5"

/** the files of the session directory (the state decompressed) that hold `needle` (grep skips sparse holes) */
const filesHolding = (dir: string, needle: string): Array<string> => {
  const grep = (args: ReadonlyArray<string>, input?: Buffer) => {
    try {
      return execFileSync("grep", [...args], { input, maxBuffer: 64 * 1024 * 1024 }).toString()
    } catch (error) {
      // grep exits 1 when nothing matched
      if ((error as { status?: number }).status === 1) return ""
      throw error
    }
  }
  const hits = grep(["-rlaF", "--exclude=memory.state", needle, dir])
    .split("\n")
    .filter((line) => line !== "")
    .map((file) => path.basename(file))
  const state = path.join(dir, "memory.state")
  if (fs.existsSync(state)) {
    const text = execFileSync("sh", ["-c", `zstd -dcq "$1" 2>/dev/null || cat "$1"`, "sh", state], {
      maxBuffer: 2 * 1024 * 1024 * 1024
    })
    if (text.includes(Buffer.from(needle))) hits.push("memory.state")
  }
  return hits
}

describe.skipIf(skip !== undefined)("suspend and resume with memory (real VM)", () => {
  it.live(
    "a turn's loop counts on after suspend + resume; the guest trusts the new CA; no credential in the state; used once; a misfit cold-boots",
    () => {
      const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-suspend-vm-"))
      const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-suspend-vm-src-"))
      fs.writeFileSync(path.join(source, "README.md"), "# suspend\n")
      process.env[CANARY_VAR] = CANARY
      const warnings: Array<string> = []
      const logger = Logger.replace(
        Logger.defaultLogger,
        Logger.make(({ message }) => {
          warnings.push(String(Array.isArray(message) ? message.join(" ") : message))
        })
      )
      return Effect.gen(function* () {
        yield* Effect.promise(() => ensureTestImage())
        fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
        const policy = {
          format: 1 as const,
          allow: [],
          credentials: [{ host: "api.example.test", header: "x-api-key", fromEnv: CANARY_VAR }],
          resolve: {}
        }

        const { id, dir, before } = yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* open({ source, memoryMiB: 512, policy })
            expect(session.restored).toBe(false)
            yield* runTurn(session.connection, LOOP)
            const before = Number((yield* runTurn(session.connection, "cat /tmp/counter")).trim())
            expect(before).toBeGreaterThan(0)
            const manifest = yield* session.suspend
            expect(manifest.bytes).toBeGreaterThan(0)
            return { id: session.id, dir: session.dir, before }
          })
        )
        const files = savedStateFiles(dir)
        expect(fs.statSync(files.state).mode & 0o777).toBe(0o600)
        expect(fs.statSync(files.manifest).mode & 0o777).toBe(0o600)
        expect(savedStateBytes(dir)).toBeGreaterThan(0)
        expect(filesHolding(dir, CANARY)).toEqual([])

        // restored: the loop counted on, and the guest trusts this process's CA
        yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* resume(id, { memoryMiB: 512 })
            expect(session.restored).toBe(true)
            expect(fs.existsSync(files.manifest)).toBe(false)
            const counts = (yield* runTurn(
              session.connection,
              "a=$(cat /tmp/counter); sleep 1; echo $a $(cat /tmp/counter)"
            ))
              .trim()
              .split(" ")
              .map(Number)
            expect(counts[0]).toBeGreaterThanOrEqual(before)
            expect(counts[1]).toBeGreaterThan(counts[0]!)
            const trusted = yield* runTurn(session.connection, "cat /run/abox/session-ca.pem")
            const config = JSON.parse(fs.readFileSync(path.join(dir, "guest-config.json"), "utf8")) as {
              brokerCaCert: string
            }
            expect(trusted.trim()).toBe(config.brokerCaCert.trim())
            yield* runTurn(session.connection, "echo kept > $HOME/kept.txt; sync")
            // a secret-shaped string only a guest process's memory holds, for the scrub below
            yield* runTurn(
              session.connection,
              `K=sk-ant-; S="\${K}${GUEST_SECRET_TAIL}" setsid sleep 600 </dev/null >/dev/null 2>&1 & sleep 0.2`
            )
            // suspended again, for the misfit below
            yield* session.suspend
          })
        )
        expect(filesHolding(dir, CANARY)).toEqual([])
        // abox scrub reads the (zstd) state and finds the guest's secret; it leaves the state as it is
        const stateBefore = fs.statSync(files.state)
        const scanned = yield* scanMemoryStates()
        expect(scanned.statesScanned).toBe(1)
        expect(scanned.problems).toEqual([])
        expect(scanned.findings.map((f) => [f.path, f.changed, f.kinds.includes("anthropic-key")])).toEqual([
          [files.state, false, true]
        ])
        expect(fs.statSync(files.state).mtimeMs).toBe(stateBefore.mtimeMs)

        // another -m: the state does not fit; a cold boot from the disks, said why; the state is gone
        yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* resume(id, { memoryMiB: 640 })
            expect(session.restored).toBe(false)
            expect((yield* runTurn(session.connection, "cat $HOME/kept.txt")).trim()).toBe("kept")
            expect(
              (yield* runTurn(session.connection, "cat /tmp/counter 2>/dev/null || echo none")).trim()
            ).toBe("none")
          })
        )
        expect(warnings.some((w) => w.includes("memory (MiB) was 512, is 640"))).toBe(true)
        expect(fs.existsSync(files.state)).toBe(false)
      }).pipe(Effect.provide(layerFor(home)), Effect.provide(logger))
    },
    480_000
  )
})
