/**
 * The file tools on special files and slow files, with the real child that does their file
 * operations as the repository owner (65534 when the tests run as root): a FIFO (with and
 * without a process at its other end), a device, a unix socket and a directory are refused at
 * once; a file operation the owner stalls (SIGSTOP: the owner may signal its own processes) is
 * ended by a cancel, its child killed, and the next tool call runs; the child runs as the owner
 * and without the turn's environment (NODE_OPTIONS).
 */
import { afterEach, describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { spawn, spawnSync } from "node:child_process"
import { ReadLedger } from "../src/guest/model/fileText.js"
import { killAllFileOps } from "../src/guest/model/ownerFiles.js"
import { makeHandlers } from "../src/guest/model/tools.js"
import type { TurnUser } from "../src/guest/user.js"
import { alive, processesMentioning } from "./support/processes.js"

const isRoot = process.getuid?.() === 0
const owner: TurnUser | undefined = isRoot ? { name: "nobody", uid: 65534, gid: 65534, home: "/" } : undefined

/** the test's temporary directories, removed after it (rm(1) does not follow links) */
const made: Array<string> = []
afterEach(() => {
  // each test's handlers keep their owner child; it ends with the test (a turn ends it in the agent)
  killAllFileOps()
  for (const dir of made.splice(0)) spawnSync("rm", ["-rf", dir])
})

const repo = () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-owner-files-"))
  made.push(dir)
  fs.writeFileSync(path.join(dir, "a.txt"), "one\ntwo\n")
  if (owner !== undefined) {
    fs.chmodSync(dir, 0o755)
    fs.chownSync(dir, owner.uid, owner.gid)
    fs.chownSync(path.join(dir, "a.txt"), owner.uid, owner.gid)
  }
  return dir
}
/**
 * every file counts as read: these tests are of what an edit does to a special file once it gets
 * that far (read-before-edit has its own tests in agent.units)
 */
class EverythingRead extends ReadLedger {
  override has(): boolean {
    return true
  }
}
const handlersFor = (dir: string, env: Record<string, string> = {}) =>
  makeHandlers({
    repoDir: dir,
    user: owner,
    env: { PATH: process.env.PATH ?? "/usr/bin:/bin", HOME: dir, ...env },
    ledger: new EverythingRead()
  })

/** a tool call must answer within this (the old in-process open of a FIFO never did) */
const bounded = <A, E>(effect: Effect.Effect<A, E>) =>
  effect.pipe(
    Effect.timeoutFail({ duration: "10 seconds", onTimeout: () => new Error("the tool call hung") })
  )

/** a child working in `dir` (other tests' children are elsewhere) */
const ownedByThisTest = (pid: number, dir: string): boolean => {
  try {
    return fs.readlinkSync(`/proc/${pid}/cwd`) === fs.realpathSync(dir)
  } catch {
    return false
  }
}

/** the child's command line holds its source; this phrase is in it */
const CHILD_MARK = "only regular files are read or written"

describe("file tools on special files", () => {
  it.live("a FIFO with a reader, a device and a socket are refused; nothing is written into them", () =>
    Effect.gen(function* () {
      const dir = repo()
      const h = handlersFor(dir)
      const fifo = path.join(dir, "fifo")
      expect(spawnSync("mkfifo", ["-m", "666", fifo]).status).toBe(0)
      // a process at the FIFO's other end: an open for writing would succeed and the write land
      const reader = fs.openSync(fifo, fs.constants.O_RDONLY | fs.constants.O_NONBLOCK)
      try {
        const wrote = yield* bounded(h.write_file({ path: "fifo", content: "into the pipe" }))
        expect(wrote.isError).toBe(true)
        expect(wrote.output).toContain("is a FIFO")
        const buffer = Buffer.alloc(64)
        // nothing arrived (no writer: end of file; a writer still there: EAGAIN)
        const arrived = (() => {
          try {
            return fs.readSync(reader, buffer)
          } catch {
            return 0
          }
        })()
        expect(arrived).toBe(0)
        const edited = yield* bounded(h.edit_file({ path: "fifo", old_string: "a", new_string: "b" }))
        expect(edited).toMatchObject({ isError: true })
        expect(edited.output).toContain("is a FIFO")
      } finally {
        fs.closeSync(reader)
      }
      const server = net.createServer()
      yield* Effect.async<void>((resume) => {
        server.listen(path.join(dir, "sock"), () => resume(Effect.void))
      })
      try {
        for (const result of [
          yield* bounded(h.read_file({ path: "sock" })),
          yield* bounded(h.write_file({ path: "sock", content: "x" })),
          yield* bounded(h.edit_file({ path: "sock", old_string: "a", new_string: "b" }))
        ]) {
          expect(result.isError, result.output).toBe(true)
          expect(result.output).toContain("is a socket")
        }
      } finally {
        server.close()
      }
      const sub = yield* bounded(h.write_file({ path: ".", content: "x" }))
      expect(sub.isError).toBe(true)
      if (isRoot) {
        // /dev/zero's numbers: an open read would fill the whole buffer with zeros
        expect(spawnSync("mknod", [path.join(dir, "zero"), "c", "1", "5"]).status).toBe(0)
        fs.chmodSync(path.join(dir, "zero"), 0o666)
        const read = yield* bounded(h.read_file({ path: "zero" }))
        expect(read.isError, read.output).toBe(true)
        expect(read.output).toContain("is a device")
        const write = yield* bounded(h.write_file({ path: "zero", content: "x" }))
        expect(write.output).toContain("is a device")
      }
      // the tools still work on a regular file, and it is the owner's
      expect((yield* h.write_file({ path: "new/b.txt", content: "b\n" })).isError).toBe(false)
      expect((yield* h.read_file({ path: "new/b.txt" })).output).toBe("1\tb")
      if (owner !== undefined) {
        expect(fs.statSync(path.join(dir, "new/b.txt")).uid).toBe(owner.uid)
        expect(fs.statSync(path.join(dir, "new")).uid).toBe(owner.uid)
      }
    })
  )

  it.live("a FIFO with nobody at its other end: read_file, write_file, edit_file and list_files answer", () =>
    Effect.gen(function* () {
      const dir = repo()
      const h = handlersFor(dir)
      expect(spawnSync("mkfifo", ["-m", "666", path.join(dir, "fifo")]).status).toBe(0)
      const results = [
        yield* bounded(h.read_file({ path: "fifo" })),
        yield* bounded(h.write_file({ path: "fifo", content: "x" })),
        yield* bounded(h.edit_file({ path: "fifo", old_string: "a", new_string: "b" })),
        yield* bounded(h.list_files({ path: "fifo" }))
      ]
      for (const result of results) expect(result.isError, result.output).toBe(true)
      for (const result of results.slice(0, 3)) expect(result.output).toContain("is a FIFO")
    })
  )

  it.live("a stalled file operation is ended by a cancel, its child killed; the next call runs", () =>
    Effect.gen(function* () {
      const dir = repo()
      const marker = path.join(dir, "preloaded")
      fs.writeFileSync(
        path.join(dir, "evil.cjs"),
        `require("node:fs").writeFileSync(${JSON.stringify(marker)}, "x")`
      )
      fs.chmodSync(path.join(dir, "evil.cjs"), 0o644)
      // the turn's environment names a preload: the child must not run it
      const h = handlersFor(dir, { NODE_OPTIONS: `--require ${path.join(dir, "evil.cjs")}` })
      // big enough that the child is still reading its request when it is stopped
      const fiber = yield* Effect.fork(
        h.write_file({ path: "big.txt", content: "x".repeat(64 * 1024 * 1024) })
      )
      let child: number | undefined
      for (let i = 0; i < 2000 && child === undefined; i++) {
        child = processesMentioning(CHILD_MARK).find((pid) => ownedByThisTest(pid, dir))
        if (child === undefined) yield* Effect.sleep("2 millis")
      }
      expect(child, "a child does the file operation").toBeDefined()
      if (owner !== undefined) {
        const status = fs.readFileSync(`/proc/${child}/status`, "utf8")
        expect(status).toMatch(new RegExp(`^Uid:\\s+${owner.uid}\\s+${owner.uid}\\s`, "m"))
      }
      // the owner stops its own process: the operation would never end
      process.kill(child!, "SIGSTOP")
      yield* Effect.sleep("200 millis")
      expect(fiber.unsafePoll()).toBeNull()
      yield* bounded(Fiber.interrupt(fiber))
      for (let i = 0; i < 100 && alive(child!); i++) yield* Effect.sleep("20 millis")
      expect(alive(child!)).toBe(false)
      const next = yield* bounded(h.edit_file({ path: "a.txt", old_string: "two", new_string: "2" }))
      expect(next.isError, next.output).toBe(false)
      expect(fs.readFileSync(path.join(dir, "a.txt"), "utf8")).toBe("one\n2\n")
      expect(fs.existsSync(marker)).toBe(false)
    })
  )
})

describe("the owner's child", () => {
  it.live(
    "one child serves the file operations that follow, as the owner; a cancel ends it and the next call starts another",
    () =>
      Effect.gen(function* () {
        const dir = repo()
        const h = handlersFor(dir)
        const mine = () => processesMentioning(CHILD_MARK).filter((pid) => ownedByThisTest(pid, dir))
        expect((yield* h.read_file({ path: "a.txt" })).output).toBe("1\tone\n2\ttwo")
        const first = mine()
        expect(first, "the child stays after its operation").toHaveLength(1)
        expect((yield* h.write_file({ path: "b.txt", content: "b\n" })).isError).toBe(false)
        expect((yield* h.edit_file({ path: "b.txt", old_string: "b", new_string: "c" })).isError).toBe(false)
        expect((yield* h.read_file({ path: "b.txt" })).output).toBe("1\tc")
        expect(mine(), "the same child did every operation").toEqual(first)
        if (owner !== undefined) {
          const status = fs.readFileSync(`/proc/${first[0]}/status`, "utf8")
          expect(status).toMatch(new RegExp(`^Uid:\\s+${owner.uid}\\s+${owner.uid}\\s`, "m"))
          expect(fs.readFileSync(`/proc/${first[0]}/environ`, "utf8")).toBe("")
        }
        // a cancel in the middle of an operation: the child goes, the next operation has a new one
        process.kill(first[0]!, "SIGSTOP")
        const fiber = yield* Effect.fork(h.read_file({ path: "a.txt" }))
        yield* Effect.sleep("100 millis")
        yield* bounded(Fiber.interrupt(fiber))
        for (let i = 0; i < 100 && alive(first[0]!); i++) yield* Effect.sleep("20 millis")
        expect(alive(first[0]!)).toBe(false)
        expect((yield* bounded(h.read_file({ path: "b.txt" }))).output).toBe("1\tc")
        const second = mine()
        expect(second).toHaveLength(1)
        expect(second).not.toEqual(first)
        killAllFileOps()
        for (let i = 0; i < 100 && alive(second[0]!); i++) yield* Effect.sleep("20 millis")
        expect(alive(second[0]!), "the last-resort kill ends the child").toBe(false)
      })
  )
})

describe("the owner's child in an imported image", () => {
  it.live("starts through the node that ABOX_NODE names (there, process.execPath is abox's loader)", () =>
    Effect.gen(function* () {
      const dir = repo()
      const bin = fs.mkdtempSync(path.join(os.tmpdir(), "abox-owner-node-"))
      made.push(bin)
      fs.chmodSync(bin, 0o777)
      const wrapper = path.join(bin, "node")
      fs.writeFileSync(wrapper, `#!/bin/sh\necho used > ${bin}/used\nexec ${process.execPath} "$@"\n`, {
        mode: 0o755
      })
      const before = process.env.ABOX_NODE
      process.env.ABOX_NODE = wrapper
      try {
        const h = handlersFor(dir)
        expect((yield* bounded(h.read_file({ path: "a.txt" }))).output).toBe("1\tone\n2\ttwo")
      } finally {
        if (before === undefined) delete process.env.ABOX_NODE
        else process.env.ABOX_NODE = before
      }
      expect(fs.existsSync(path.join(bin, "used")), "the wrapper started the child").toBe(true)
    })
  )
})

describe("the owner's child, written to by the owner", () => {
  it.live(
    "a reply the owner forges into its idle child's stdout cannot be written (a socket, not a pipe); the next call reads the file",
    () =>
      Effect.gen(function* () {
        const dir = repo()
        const h = handlersFor(dir)
        const mine = () => processesMentioning(CHILD_MARK).filter((pid) => ownedByThisTest(pid, dir))
        expect((yield* h.read_file({ path: "a.txt" })).isError).toBe(false)
        const [idle] = mine()
        expect(idle).toBeDefined()
        // the owner may open its own processes' descriptors through /proc: not a socket's
        const forged = spawnSync(
          "/bin/sh",
          ["-c", `printf '{"id":2,"ok":true,"data":"Zm9yZ2Vk"}\\n' > /proc/${idle}/fd/1`],
          owner === undefined ? {} : { uid: owner.uid, gid: owner.gid }
        )
        expect(forged.status).not.toBe(0)
        expect(forged.stderr.toString()).toContain("No such device or address")
        const next = yield* bounded(h.read_file({ path: "a.txt" }))
        expect(next.output).toBe("1\tone\n2\ttwo")
        expect(mine()).toEqual([idle])
      })
  )
})

describe.skipIf(!isRoot || os.arch() !== "x64" || spawnSync("perl", ["-e", "1"]).status !== 0)(
  "list_files and search enter their directory as the owner",
  () => {
    it.live("a directory swapped for a symlink after the check leads only where the owner may go", () =>
      Effect.gen(function* () {
        const dir = repo()
        fs.mkdirSync(path.join(dir, "sub"))
        fs.writeFileSync(path.join(dir, "sub", "mine.txt"), "mine\n")
        spawnSync("chown", ["-R", "65534:65534", path.join(dir, "sub")])
        // a directory the owner cannot reach (its parent is root's, 0700), holding a readable file
        const hidden = fs.mkdtempSync(path.join(os.tmpdir(), "abox-owner-hidden-"))
        fs.mkdirSync(path.join(hidden, "inner"), { mode: 0o755 })
        fs.writeFileSync(path.join(hidden, "inner", "root-secret.txt"), "needle-of-root\n", { mode: 0o644 })
        fs.symlinkSync(path.join(hidden, "inner"), path.join(dir, "alt"))
        fs.lchownSync(path.join(dir, "alt"), 65534, 65534)
        // the owner swaps sub and alt (renameat2 RENAME_EXCHANGE, syscall 316 on x86_64) in a loop
        const racer = spawn(
          "perl",
          [
            "-e",
            'my ($a, $b) = ("sub", "alt"); my $end = time + 20; while (time < $end) { syscall(316, -100, $a, -100, $b, 2); }'
          ],
          { cwd: dir, uid: 65534, gid: 65534, stdio: "ignore" }
        )
        try {
          const h = handlersFor(dir)
          const seen: Array<string> = []
          for (let i = 0; i < 150; i++) {
            const listed = yield* h.list_files({ path: "sub" })
            const searched = yield* h.search({ pattern: "needle-of", path: "sub" })
            seen.push(listed.output, searched.output)
          }
          expect(
            seen.filter((output) => output.includes("root-secret") || output.includes("needle-of-root"))
          ).toEqual([])
          // the swap did happen: some calls were refused by the check, some passed it
          expect(seen.some((output) => output.startsWith("refused:"))).toBe(true)
          expect(seen.some((output) => !output.startsWith("refused:"))).toBe(true)
        } finally {
          racer.kill("SIGKILL")
          fs.rmSync(hidden, { recursive: true, force: true })
        }
      })
    )
  }
)
