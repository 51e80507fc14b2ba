/**
 * The helper supervisor shared by the QEMU and vz backends (src/vmm/supervisor.ts), driven with
 * stand-in helpers (real processes, no VMM binary needed): what the helper is given (the spec on
 * stdin, the lock on fd 4, the liveness pipe on fd 3), each way start can fail, and each Close
 * outcome with the backend's fallback signal and cleanup.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Scope from "effect/Scope"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import type { VmSpec } from "../src/domain/vm.js"
import type { HelperSpec } from "../src/vmm/protocol.js"
import { processGone, superviseHelper, type SupervisorOptions } from "../src/vmm/supervisor.js"
import { spawnSync } from "node:child_process"
import { alive } from "./support/processes.js"

type Behaviour =
  /** reports a `sleep` as its VMM; on SIGINT/SIGTERM kills it, reports its exit and exits */
  | "honour"
  /** reports a `sleep` as its VMM and ignores every signal but SIGKILL */
  | "ignore"
  /** reports a `sleep` as its VMM, which then exits 7 by itself */
  | "crash"
  /** writes to stderr and exits 3 before any event */
  | "die"
  /** reports an `error` event, then exits */
  | "error"

/**
 * A stand-in helper: writes what it was given (the stdin line, the inode on fd 4, whether fd 3
 * is open) and the signal it received into <dir>/record-*.json, and behaves as told.
 */
const standIn = (dir: string, behaviour: Behaviour): string => {
  const file = path.join(dir, `helper-${behaviour}.cjs`)
  fs.writeFileSync(
    file,
    `const fs = require("node:fs")
const { spawn } = require("node:child_process")
const out = (event) => process.stdout.write(JSON.stringify(event) + "\\n")
const stat = (fd) => { try { return fs.fstatSync(fd).ino } catch { return null } }
const record = (name, value) => fs.writeFileSync(${JSON.stringify(dir)} + "/record-" + name + ".json", JSON.stringify(value))
let input = ""
process.stdin.setEncoding("utf8")
process.stdin.on("data", (chunk) => { input += chunk })
process.stdin.on("end", () => record("given", { input, lock: stat(4), liveness: stat(3) !== null }))
const behaviour = ${JSON.stringify(behaviour)}
if (behaviour === "die") { process.stderr.write("no vmm here\\n"); setTimeout(() => process.exit(3), 50) }
else if (behaviour === "error") { out({ event: "error", message: "cannot start vmm: ENOENT" }); setTimeout(() => process.exit(69), 50) }
else {
  const vmm = spawn(behaviour === "crash" ? "sh" : "sleep", behaviour === "crash" ? ["-c", "sleep 0.2; exit 7"] : ["300"], { stdio: "ignore" })
  out({ event: "started", pid: vmm.pid })
  vmm.on("exit", (code, signal) => { out({ event: "exited", code, signal }); if (behaviour !== "ignore") process.exit(0) })
  const onSignal = (signal) => { record("signal", signal); if (behaviour === "honour") vmm.kill("SIGKILL") }
  process.on("SIGTERM", onSignal)
  process.on("SIGINT", onSignal)
  setInterval(() => {}, 1 << 30)
}
`
  )
  return file
}

const readRecord = (dir: string, name: string): unknown => {
  const file = path.join(dir, `record-${name}.json`)
  return fs.existsSync(file) ? JSON.parse(fs.readFileSync(file, "utf8")) : undefined
}

interface Setup {
  readonly dir: string
  readonly lockFd: number
  readonly cleaned: Array<string>
  readonly options: SupervisorOptions
}

const setup = (
  behaviour: Behaviour,
  fallbackSignal: "SIGINT" | "SIGTERM",
  bounds: VmSpec["bounds"] = { graceful: "300 millis", signalled: "1 second", killed: "3 seconds" }
): Setup => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-supervisor-"))
  fs.writeFileSync(path.join(dir, "console.log"), "boot line\nlast words\n")
  const lockFd = fs.openSync(path.join(dir, "lock"), "w")
  const cleaned: Array<string> = []
  const helperSpec: HelperSpec = {
    command: "/nonexistent/vmm",
    args: ["--flag", "value"],
    env: { PATH: "/usr/bin:/bin" },
    consoleLog: path.join(dir, "vmm.log"),
    consoleMaxBytes: 1024,
    signal: fallbackSignal,
    quitMs: 100,
    termMs: 100
  }
  return {
    dir,
    lockFd,
    cleaned,
    options: {
      backend: "vz",
      vmmName: "stand-in-vmm",
      helper: [process.execPath, standIn(dir, behaviour)],
      helperSpec,
      fallbackSignal,
      vm: { lockFd, consoleLog: path.join(dir, "console.log"), bounds },
      cleanup: Effect.sync(() => {
        cleaned.push("socket")
      })
    }
  }
}

describe.skipIf(process.platform !== "linux")("the helper supervisor, with stand-in helpers", () => {
  for (const fallbackSignal of ["SIGINT", "SIGTERM"] as const) {
    it.live(
      `the helper gets its spec, the lock fd and the liveness pipe; Close sends ${fallbackSignal}`,
      () =>
        Effect.gen(function* () {
          const { cleaned, dir, lockFd, options } = setup("honour", fallbackSignal)
          const scope = yield* Scope.make()
          const handle = yield* superviseHelper(options).pipe(Scope.extend(scope))
          expect(handle.backend).toBe("vz")
          expect(alive(handle.vmmPid)).toBe(true)
          expect(alive(handle.helperPid)).toBe(true)
          yield* Scope.close(scope, Exit.void)
          const outcome = yield* handle.outcome
          expect(outcome).toMatchObject({ how: "signalled", exitCode: null, signal: "SIGKILL" })
          expect(outcome.consoleTail).toEqual(["boot line", "last words"])
          expect(readRecord(dir, "signal")).toBe(fallbackSignal)
          expect(readRecord(dir, "given")).toEqual({
            input: JSON.stringify(options.helperSpec) + "\n",
            lock: fs.fstatSync(lockFd).ino,
            liveness: true
          })
          expect(cleaned).toEqual(["socket"])
          expect(alive(handle.vmmPid)).toBe(false)
          expect(alive(handle.helperPid)).toBe(false)
          fs.closeSync(lockFd)
        })
    )
  }

  it.live(
    "a helper that ignores the signal is SIGKILLed with its VMM; both are gone when Close returns",
    () =>
      Effect.gen(function* () {
        const { cleaned, lockFd, options } = setup("ignore", "SIGINT")
        const scope = yield* Scope.make()
        const handle = yield* superviseHelper(options).pipe(Scope.extend(scope))
        const before = Date.now()
        yield* Scope.close(scope, Exit.void)
        const outcome = yield* handle.outcome
        expect(outcome).toMatchObject({ how: "killed", exitCode: null, signal: "SIGKILL" })
        // graceful 300 ms + signalled 1 s, then the kill: well inside the killed bound
        expect(Date.now() - before).toBeLessThan(3000)
        expect(alive(handle.vmmPid)).toBe(false)
        expect(alive(handle.helperPid)).toBe(false)
        expect(cleaned).toEqual(["socket"])
        fs.closeSync(lockFd)
      })
  )

  it.live("a VMM that exits by itself before Close: crashed, with its exit code and the console tail", () =>
    Effect.gen(function* () {
      const { cleaned, dir, lockFd, options } = setup("crash", "SIGTERM")
      const scope = yield* Scope.make()
      const handle = yield* superviseHelper(options).pipe(Scope.extend(scope))
      expect(yield* handle.exited).toEqual({ exitCode: 7, signal: null })
      yield* Scope.close(scope, Exit.void)
      const outcome = yield* handle.outcome
      expect(outcome).toMatchObject({ how: "crashed", exitCode: 7, signal: null })
      expect(outcome.consoleTail).toEqual(["boot line", "last words"])
      expect(readRecord(dir, "signal")).toBeUndefined()
      expect(cleaned).toEqual(["socket"])
      fs.closeSync(lockFd)
    })
  )

  it.live(
    "a helper that dies before `started`: start fails naming the VMM and the helper's stderr; Close still runs",
    () =>
      Effect.gen(function* () {
        const { cleaned, lockFd, options } = setup("die", "SIGTERM")
        const scope = yield* Scope.make()
        const error = yield* superviseHelper(options).pipe(Scope.extend(scope), Effect.flip)
        expect(error._tag).toBe("VmmError")
        expect(error).toMatchObject({ backend: "vz", reason: "helper" })
        expect(error.message).toContain("before starting stand-in-vmm")
        expect(error.message).toContain("no vmm here")
        yield* Scope.close(scope, Exit.void)
        expect(cleaned).toEqual(["socket"])
        fs.closeSync(lockFd)
      })
  )

  it.live("a helper that reports an error: start fails with it", () =>
    Effect.gen(function* () {
      const { cleaned, lockFd, options } = setup("error", "SIGTERM")
      const scope = yield* Scope.make()
      const error = yield* superviseHelper(options).pipe(Scope.extend(scope), Effect.flip)
      expect(error).toMatchObject({ backend: "vz", reason: "start", message: "cannot start vmm: ENOENT" })
      yield* Scope.close(scope, Exit.void)
      expect(cleaned).toEqual(["socket"])
      fs.closeSync(lockFd)
    })
  )

  it.live(
    "a helper argv that cannot be spawned: start fails with a VmmError; Close still ends within its bounds",
    () =>
      Effect.gen(function* () {
        const bounds: VmSpec["bounds"] = {
          graceful: "100 millis",
          signalled: "100 millis",
          killed: "100 millis"
        }
        const { cleaned, lockFd, options } = setup("honour", "SIGTERM", bounds)
        const scope = yield* Scope.make()
        const error = yield* superviseHelper({ ...options, helper: ["/nonexistent/abox-vmm"] }).pipe(
          Scope.extend(scope),
          Effect.flip
        )
        expect(error).toMatchObject({ backend: "vz", reason: "helper" })
        expect(error.message).toContain("ENOENT")
        // ENOENT arrives as an 'error' event with no 'exit': no exit ever comes, so Close walks
        // every bound (graceful, signalled, killed) and then records the end itself
        const before = Date.now()
        yield* Scope.close(scope, Exit.void)
        expect(Date.now() - before).toBeLessThan(2000)
        expect(cleaned).toEqual(["socket"])
        fs.closeSync(lockFd)
      })
  )
})

describe("processGone: the VMM's end, seen from the supervisor", () => {
  it("with /proc (Linux) and without one (macOS): a live process is there, an exited and reaped one gone", () => {
    const child = spawnSync(process.execPath, ["-e", "0"])
    expect(child.status).toBe(0)
    const reaped = child.pid
    for (const procDir of ["/proc", path.join(os.tmpdir(), "no-proc-here")]) {
      expect(processGone(process.pid, procDir), procDir).toBe(false)
      expect(processGone(reaped, procDir), procDir).toBe(true)
    }
  })
})
