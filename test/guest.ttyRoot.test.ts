/**
 * The tty turn's files against a hostile turn user, with the real BusyBox telnetd and the
 * runner as root (the tests run as root here; the turn user is 65534): the command finds the
 * turn's directory (its wrapper's path, in its parent's command line) and attacks what the root
 * agent does with it after the turn:
 * - a racer left running (its own session, so the end-of-turn kill misses it) swaps
 *   directories of the turn's directory with symlinks to a root-owned directory
 *   (renameat2 RENAME_EXCHANGE, in a loop) while the agent removes the turn's directory: the
 *   root-owned files must all still be there;
 * - the pid file names a root process group: the agent's end-of-turn SIGKILL must not reach it;
 * - the pid file becomes a symlink to a FIFO: the turn must still end.
 */
import { spawn, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { afterEach, describe, expect, it } from "@effect/vitest"
import { BUSYBOX, TtyTurnRunner } from "../src/guest/ttyTurns.js"
import { alive } from "./support/processes.js"

const isRoot = process.getuid?.() === 0
const hasPerl = spawnSync("perl", ["-e", "1"]).status === 0
const canRun = fs.existsSync(BUSYBOX) && isRoot && hasPerl && os.arch() === "x64"

/** temporary directories of the test, removed after it (rm(1) does not follow links) */
const made: Array<string> = []
const tempDir = (prefix: string) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), prefix))
  made.push(dir)
  return dir
}
afterEach(() => {
  for (const dir of made.splice(0)) spawnSync("rm", ["-rf", dir])
})

const makeRunner = () => {
  const repoDir = tempDir("abox-tty-root-repo-")
  fs.chmodSync(repoDir, 0o755)
  fs.chownSync(repoDir, 65534, 65534)
  const runner = new TtyTurnRunner({
    repoDir,
    model: "test",
    user: { name: "nobody", uid: 65534, gid: 65534, home: "/" },
    killAfterMs: 2000
  })
  return { runner, repoDir }
}

/** the turn's directory, from the command's parent (the wrapper, `/bin/sh <dir>/wrapper`) */
const FIND_DIR = `d=$(dirname "$(tr '\\0' '\\n' < /proc/$PPID/cmdline | tail -n 1)")`

/** resolves with the turn's outcome, or "hung" after `ms` */
const within = <A>(promise: Promise<A>, ms: number): Promise<A | "hung"> =>
  Promise.race([promise, new Promise<"hung">((resolve) => setTimeout(() => resolve("hung"), ms).unref())])

describe.skipIf(!canRun)("tty turns: the root agent and the turn user's files", () => {
  it(
    "a RENAME_EXCHANGE racer cannot make the directory's removal delete root's files",
    { timeout: 60_000 },
    async () => {
      const victim = tempDir("abox-tty-victim-")
      fs.chmodSync(victim, 0o755)
      const names = Array.from({ length: 50 }, (_, i) => `f${i}`)
      for (const name of names) fs.writeFileSync(path.join(victim, name), "root's\n")
      const { runner, repoDir } = makeRunner()
      const racerPid = path.join(repoDir, "racer.pid")
      // renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE): syscall 316 on x86_64
      const racer = [
        "use POSIX;",
        "POSIX::setsid();",
        "my $d = shift;",
        "my $end = time + 8;",
        "while (time < $end) {",
        '  for my $i (0..19) { syscall(316, -100, "$d/d$i", -100, "$d/l$i", 2); }',
        "}"
      ].join(" ")
      const command = [
        FIND_DIR,
        `for i in $(seq 0 19); do mkdir "$d/d$i" || exit 3; for f in ${names.join(" ")}; do : > "$d/d$i/$f"; done; ln -s ${victim} "$d/l$i"; done`,
        `perl -e '${racer}' "$d" </dev/null >/dev/null 2>&1 & echo $! > ${racerPid}`,
        "sleep 0.3"
      ].join("; ")
      try {
        const outcome = await within(
          runner.run(1, command, { rows: 24, cols: 80 }, () => undefined).catch((error: unknown) => error),
          30_000
        )
        // removals still in flight after a failed rm land first
        await new Promise((resolve) => setTimeout(resolve, 500))
        expect(fs.readdirSync(victim).sort()).toEqual([...names].sort())
        expect(outcome).toMatchObject({ cancelled: false })
      } finally {
        const pid = Number(fs.existsSync(racerPid) ? fs.readFileSync(racerPid, "utf8") : NaN)
        if (Number.isInteger(pid) && pid > 1) spawnSync("kill", ["-KILL", String(pid)])
      }
    }
  )

  it(
    "a pid file naming a root process group: the end-of-turn kill does not reach it",
    { timeout: 60_000 },
    async () => {
      const root = spawn("sleep", ["300"], { detached: true, stdio: "ignore" })
      try {
        const { runner } = makeRunner()
        const outcome = await within(
          runner.run(
            1,
            `${FIND_DIR}; echo ${root.pid} > "$d/pid"; exit 4`,
            { rows: 24, cols: 80 },
            () => undefined
          ),
          30_000
        )
        expect(outcome).toEqual({ exitCode: 4, signal: null, cancelled: false })
        await new Promise((resolve) => setTimeout(resolve, 300))
        expect(alive(root.pid!)).toBe(true)
      } finally {
        root.kill("SIGKILL")
      }
    }
  )

  it("a pid file swapped for a symlink to a FIFO: the turn still ends", { timeout: 60_000 }, async () => {
    const { runner, repoDir } = makeRunner()
    const fifo = path.join(repoDir, "fifo")
    const outcome = runner.run(
      1,
      `${FIND_DIR}; mkfifo ${fifo}; rm -f "$d/pid"; ln -s ${fifo} "$d/pid"; exit 5`,
      { rows: 24, cols: 80 },
      () => undefined
    )
    try {
      const result = await within(outcome, 15_000)
      expect(result).not.toBe("hung")
      expect(result).toMatchObject({ exitCode: 5 })
    } finally {
      // release a reader stuck on the FIFO (the old agent's) so the worker can end
      if (fs.existsSync(fifo)) fs.closeSync(fs.openSync(fifo, fs.constants.O_RDWR | fs.constants.O_NONBLOCK))
    }
  })
})
