/**
 * The guest's one turn slot (src/guest/turnSlot.ts), shared by shell, tty and prompt turns: one
 * turn at a time whichever its kind, claimed at once by the runner that starts it (a tty turn's
 * setup awaits files before its process starts); a cancel is carried out once, SIGTERM then
 * SIGKILL after the bound unless the turn ended first.
 */
import { afterEach, describe, expect, it, vi } from "@effect/vitest"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { BUSYBOX, TtyTurnRunner } from "../src/guest/ttyTurns.js"
import { TurnRunner } from "../src/guest/turns.js"
import { TurnSlot } from "../src/guest/turnSlot.js"

const hasBusybox = fs.existsSync(BUSYBOX)
const isRoot = process.getuid?.() === 0

afterEach(() => {
  vi.useRealTimers()
})

describe("the turn slot", () => {
  it("one claim at a time; a released claim frees it, an old claim's release does not free a newer one", () => {
    const slot = new TurnSlot()
    const first = slot.claim(1)
    expect(slot.current).toBe(1)
    expect(() => slot.claim(2)).toThrow("turn 1 is still running")
    first.release()
    expect(slot.current).toBeUndefined()
    const second = slot.claim(2)
    first.release()
    expect(slot.current).toBe(2)
    second.release()
    expect(slot.current).toBeUndefined()
  })

  it("a cancel sends SIGTERM once, SIGKILL after the bound; none once the turn has ended", () => {
    vi.useFakeTimers()
    const slot = new TurnSlot()
    const sent: Array<string> = []
    const claim = slot.claim(1)
    claim.terminate((signal) => sent.push(signal), 500)
    claim.terminate((signal) => sent.push(`again ${signal}`), 500)
    expect(claim.cancelled).toBe(true)
    expect(sent).toEqual(["SIGTERM"])
    vi.advanceTimersByTime(499)
    expect(sent).toEqual(["SIGTERM"])
    vi.advanceTimersByTime(1)
    expect(sent).toEqual(["SIGTERM", "SIGKILL"])
    claim.release()

    const ended = slot.claim(2)
    const late: Array<string> = []
    ended.terminate((signal) => late.push(signal), 500)
    ended.release()
    vi.advanceTimersByTime(10_000)
    expect(late).toEqual(["SIGTERM"])
  })
})

describe.skipIf(!hasBusybox)("shell and tty turns share it", () => {
  it("a tty turn still setting up holds the slot: a shell turn is refused, and runs once it ended", { timeout: 30_000 }, async () => {
    const repoDir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-slot-repo-"))
    fs.chmodSync(repoDir, 0o755)
    try {
      const env = {
        repoDir,
        model: "test",
        user: isRoot ? { name: "nobody", uid: 65534, gid: 65534, home: "/" } : undefined,
        killAfterMs: 2000
      }
      const slot = new TurnSlot()
      const tty = new TtyTurnRunner(env, BUSYBOX, slot)
      const shell = new TurnRunner(env, slot)
      // not awaited: the tty turn's setup (its directory, its files) is still under way
      const ttyTurn = tty.run(1, "exit 3", { rows: 24, cols: 80 }, () => undefined)
      expect(slot.current).toBe(1)
      await expect(shell.run(2, "true", () => undefined)).rejects.toThrow("turn 1 is still running")
      expect(await ttyTurn).toEqual({ exitCode: 3, signal: null, cancelled: false })
      expect(slot.current).toBeUndefined()
      expect(await shell.run(2, "exit 4", () => undefined)).toEqual({ exitCode: 4, signal: null, cancelled: false })
      expect(slot.current).toBeUndefined()
    } finally {
      fs.rmSync(repoDir, { recursive: true, force: true })
    }
  })
})
