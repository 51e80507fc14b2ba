/**
 * Open's snapshot edge cases (issue: unreadable entries, a symlinked source, sparse files, free
 * space) and the repository disk built on the host (src/lib/repoDisk.ts): exact, owned by the
 * repository user, holes kept, special files gone, no lost+found. No VM here (the VM test,
 * test/e2e-repo-vm.test.ts, boots one with these disks).
 */
import * as NodeContext from "@effect/platform-node/NodeContext"
import { describe, expect, it, layer } from "@effect/vitest"
import * as Effect from "effect/Effect"
import { execFileSync, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { buildRepoDisks, repoDiskTools, runTool, usedInodes } from "../src/lib/repoDisk.js"
import { resolveSource, scanSource } from "../src/lib/snapshot.js"

const GiB = 1024 * 1024 * 1024
const tempDir = (prefix: string) => fs.mkdtempSync(path.join(os.tmpdir(), prefix))
const isRoot = typeof process.getuid === "function" && process.getuid() === 0
const repoRoot = path.resolve(import.meta.dirname, "..")

const debugfs = (image: string, request: string) =>
  execFileSync("debugfs", ["-R", request, image], { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"] })

describe("the source", () => {
  it.effect("a source path that is a symlink is resolved once to its directory", () =>
    Effect.gen(function* () {
      const dir = tempDir("abox-src-")
      const link = path.join(tempDir("abox-link-"), "src")
      fs.symlinkSync(dir, link)
      expect(yield* resolveSource(link)).toBe(fs.realpathSync(dir))
      const file = path.join(dir, "f")
      fs.writeFileSync(file, "x")
      const notDir = yield* Effect.flip(resolveSource(file))
      expect(notDir._tag).toBe("SourceInvalid")
    })
  )

  it.effect(
    "the scan counts files, bytes and what they occupy (holes not counted), and names skipped entries",
    () =>
      Effect.gen(function* () {
        const dir = tempDir("abox-src-")
        fs.writeFileSync(path.join(dir, "a"), "12345")
        fs.mkdirSync(path.join(dir, "d"))
        fs.symlinkSync("../outside", path.join(dir, "d", "l"))
        const sparse = fs.openSync(path.join(dir, "sparse"), "w")
        fs.ftruncateSync(sparse, 3 * GiB)
        fs.closeSync(sparse)
        execFileSync("mkfifo", [path.join(dir, "d", "fifo")])
        const scan = yield* scanSource(dir)
        expect(scan).toMatchObject({ files: 3, dirs: 1, bytes: 3 * GiB + 5, skipped: ["d/fifo"] })
        expect(scan.allocated).toBeLessThan(1024 * 1024)
      })
  )

  it.skipIf(!isRoot || spawnSync("setpriv", ["--help"]).status !== 0)(
    "an unreadable file: SourceInvalid naming it, no session made, no crash (run as nobody)",
    () => {
      const home = tempDir("abox-home-")
      const source = tempDir("abox-src-")
      fs.writeFileSync(path.join(source, "ok.txt"), "fine\n")
      fs.mkdirSync(path.join(source, "sub"))
      fs.writeFileSync(path.join(source, "sub", "secret.key"), "no\n", { mode: 0o000 })
      for (const dir of [home, source, path.join(source, "sub")]) fs.chownSync(dir, 65534, 65534)
      fs.chmodSync(source, 0o755)
      const r = spawnSync(
        "setpriv",
        [
          "--reuid=65534",
          "--regid=65534",
          "--clear-groups",
          process.execPath,
          "--import",
          "tsx",
          path.join(repoRoot, "test", "support", "openAsUser.ts"),
          home,
          source
        ],
        {
          cwd: repoRoot,
          encoding: "utf8",
          env: { PATH: process.env.PATH ?? "", HOME: home },
          timeout: 60_000
        }
      )
      const result = JSON.parse(r.stdout.trim().split("\n").at(-1) ?? "{}") as {
        tag: string
        path: string
        sessions: Array<string>
      }
      expect(result.tag).toBe("SourceInvalid")
      expect(result.path).toBe(path.join(source, "sub", "secret.key"))
      expect(result.sessions).toEqual([])
      expect(r.stderr).not.toMatch(/Unhandled|uncaught/i)
    },
    90_000
  )
})

// the host tools run through @effect/platform's Command: one NodeContext for the whole block
layer(NodeContext.layer)("repository disks", (it) => {
  it("usedInodes reads dumpe2fs's free ranges", () => {
    const text = "Inode count:              32\nGroup 0:\n  Free inodes: 14-16, 20-32\n"
    expect(usedInodes(text)).toEqual([11, 12, 13, 17, 18, 19])
  })

  it.effect(
    "built on the host: exact tree, every inode the repository user's, a 3 GiB sparse file kept sparse, special files and lost+found gone",
    () =>
      Effect.gen(function* () {
        const tools = yield* repoDiskTools("qcow2")
        if (tools === undefined) return
        const source = tempDir("abox-src-")
        fs.writeFileSync(path.join(source, "run.sh"), "#!/bin/sh\n", { mode: 0o755 })
        fs.writeFileSync(path.join(source, "back\\slash"), "b\n")
        fs.mkdirSync(path.join(source, "empty"))
        fs.symlinkSync("/etc/passwd", path.join(source, "out-link"))
        const sparse = fs.openSync(path.join(source, "sparse.img"), "w")
        fs.ftruncateSync(sparse, 3 * GiB)
        fs.writeSync(sparse, "end", 3 * GiB - 3)
        fs.closeSync(sparse)
        execFileSync("mkfifo", [path.join(source, "fifo")])
        const session = tempDir("abox-session-")
        const scan = yield* scanSource(source)
        const disks = yield* buildRepoDisks(scan, session, "qcow2", tools)
        expect(disks).toBeDefined()
        if (disks === undefined) return
        expect(fs.statSync(disks.base).blocks * 512).toBeLessThan(256 * 1024 * 1024)
        expect(fs.statSync(disks.base).mode & 0o777).toBe(0o400)
        // a whole MiB (4 × (bytes + metadata) alone is a multiple of 4: vfkit refuses it)
        expect(fs.statSync(disks.base).size % (1024 * 1024)).toBe(0)
        expect(execFileSync("qemu-img", ["info", disks.repo], { encoding: "utf8" })).toContain(
          "backing file: repo-base.raw"
        )
        const listing = debugfs(disks.base, "ls -l /")
        expect(listing).not.toContain("lost+found")
        expect(listing).not.toContain("fifo")
        // (debugfs prints a backslash as \x5c)
        for (const name of ["run.sh", "back\\x5cslash", "empty", "out-link", "sparse.img"])
          expect(listing).toContain(name)
        // every entry: uid 1000, gid 1000 (columns: inode, mode, (links), uid, gid, size, ...)
        const rows = listing.split("\n").filter((line) => /^\s*\d+\s+\d+/.test(line))
        for (const row of rows) expect(row.trim().split(/\s+/).slice(3, 5)).toEqual(["1000", "1000"])
        expect(debugfs(disks.base, "stat /run.sh")).toContain("Mode:  0755")
        expect(debugfs(disks.base, "stat /out-link")).toContain('Fast link dest: "/etc/passwd"')
        expect(debugfs(disks.base, "stat /sparse.img")).toContain(`Size: ${3 * GiB}`)
      }),
    120_000
  )

  it.effect("not enough free space: DiskError no-space with the sizes, nothing made", () =>
    Effect.gen(function* () {
      const tools = yield* repoDiskTools("qcow2")
      if (tools === undefined) return
      const session = tempDir("abox-session-")
      const scan = {
        root: tempDir("abox-src-"),
        files: 1,
        dirs: 0,
        bytes: 2 ** 52,
        allocated: 2 ** 52,
        widestDir: 1,
        skipped: []
      }
      const error = yield* Effect.flip(buildRepoDisks(scan, session, "qcow2", tools))
      expect(error._tag).toBe("DiskError")
      expect(error.reason).toBe("no-space")
      expect(error.message).toMatch(/needs \d+ MiB/)
      expect(fs.readdirSync(session)).toEqual([])
    })
  )

  it.effect(
    "a host tool that cannot start, or exits non-zero: DiskError (tool) with the cause or its stderr",
    () =>
      Effect.gen(function* () {
        const missing = yield* Effect.flip(runTool("/some/disk", "/nonexistent/abox-no-such-tool", ["-x"]))
        expect(missing).toMatchObject({ _tag: "DiskError", reason: "tool", path: "/some/disk" })
        expect(missing.message).toContain("/nonexistent/abox-no-such-tool")
        // the tool's start failure itself, not a string of it
        expect(missing.cause).toMatchObject({
          _tag: "CommandNotRun",
          command: "/nonexistent/abox-no-such-tool"
        })
        const failed = yield* Effect.flip(
          runTool("/some/disk", "/bin/sh", ["-c", "echo bad input >&2; exit 3"])
        )
        expect(failed.message).toBe("sh exited 3: bad input")
        // stdin is what the caller gives, stdout what the tool wrote; the environment is abox's minimal one
        process.env.ABOX_TEST_LEAK = "inherited"
        const echoed = yield* runTool(
          "/some/disk",
          "/bin/sh",
          ["-c", 'cat; echo "[$ABOX_TEST_LEAK]"'],
          "in\n"
        )
        delete process.env.ABOX_TEST_LEAK
        expect(echoed).toBe("in\n[]\n")
      })
  )
})
