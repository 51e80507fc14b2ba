/**
 * The work-out matrix (issue 20): every case a turn can leave for `diff`, `apply` and `cp`, run
 * in order on one session whose source has no `.git` (a repository without one): nothing
 * changed, only added (an ignored path and a name with a newline among them), only deleted,
 * renamed, mode only, an unreadable file, a guest-written `.git` (top-level and nested, a
 * directory and a file), links out of the copied subtree, and a 100 GB sparse file. The same
 * cases run against FakeVmm (test/repo.test.ts: GNU tar on the host) and a real VM
 * (test/e2e-export-vm.test.ts: busybox tar, the export as the turn user).
 */
import { expect } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import type { GuestConnection } from "../../src/services/GuestRpc.js"
import * as Repo from "../../src/programs/repo.js"
import { applyToCopy } from "./trees.js"

/** a source with no `.git`, an ignore file, and files to delete, rename and chmod */
export const matrixSource = (): string => {
  const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-matrix-src-"))
  fs.writeFileSync(path.join(source, ".gitignore"), "node_modules/\n")
  fs.writeFileSync(path.join(source, "keep.txt"), "kept\n")
  fs.writeFileSync(path.join(source, "doomed.txt"), "to be deleted\n")
  fs.writeFileSync(path.join(source, "mode.sh"), "#!/bin/sh\necho mode\n", { mode: 0o644 })
  fs.writeFileSync(path.join(source, "old.txt"), "renamed content\n".repeat(20))
  return source
}

const tempDir = (prefix: string) => fs.mkdtempSync(path.join(os.tmpdir(), prefix))

/** a clean copy of the source with the session's changes applied by `apply` */
const applied = (connection: GuestConnection, source: string) =>
  Effect.gen(function* () {
    const target = tempDir("abox-matrix-apply-")
    fs.cpSync(source, target, { recursive: true })
    const paths = yield* Repo.apply(connection, { to: target })
    return { target, paths }
  })

export const exportMatrix = (
  connection: GuestConnection,
  source: string,
  run: (command: string) => Effect.Effect<string, unknown>,
  /** the turn user cannot read a mode-000 file (not so for a FakeVmm guest run as root) */
  unreadableRefused: boolean
) =>
  Effect.gen(function* () {
    // nothing changed: an empty patch, nothing to apply, and cp of the whole tree works
    expect(yield* Repo.diff(connection)).toBe("")
    expect((yield* applied(connection, source)).paths).toEqual([])
    const whole = path.join(tempDir("abox-matrix-cp-"), "tree")
    yield* Repo.copyOut(connection, ".", whole)
    expect(fs.readFileSync(path.join(whole, "keep.txt"), "utf8")).toBe("kept\n")

    // only added: a new file, one under an ignored directory, a name with a newline
    expect(
      yield* run("echo x > new.txt && mkdir -p node_modules/m && echo m > node_modules/m/i.js && printf nl > \"$(printf 'a\\nb')\" && echo ok")
    ).toContain("ok")
    const added = yield* Repo.diff(connection)
    expect(added).toContain("diff --git a/new.txt b/new.txt")
    expect(added).toContain("+x")
    expect(added).toContain("node_modules/m/i.js")
    expect(added).toContain('"a/a\\nb"')
    const copy = applyToCopy(source, added)
    expect(fs.readFileSync(path.join(copy, "a\nb"), "utf8")).toBe("nl")
    const addedApplied = yield* applied(connection, source)
    expect(addedApplied.paths).toEqual(["a\nb", "new.txt", "node_modules/m/i.js"])
    expect(fs.readFileSync(path.join(addedApplied.target, "new.txt"), "utf8")).toBe("x\n")
    const one = path.join(tempDir("abox-matrix-cp-"), "new.txt")
    yield* Repo.copyOut(connection, "new.txt", one)
    expect(fs.readFileSync(one, "utf8")).toBe("x\n")

    // and taken away again: nothing once more (on both sides of the export)
    expect(yield* run("rm -r new.txt node_modules \"$(printf 'a\\nb')\" && echo ok")).toContain("ok")
    expect(yield* Repo.diff(connection)).toBe("")

    // only deleted
    expect(yield* run("rm doomed.txt && echo ok")).toContain("ok")
    const deleted = yield* Repo.diff(connection)
    expect(deleted).toContain("deleted file mode 100644")
    expect(deleted).toContain("doomed.txt")
    const deletedApplied = yield* applied(connection, source)
    expect(deletedApplied.paths).toEqual(["doomed.txt"])
    expect(fs.existsSync(path.join(deletedApplied.target, "doomed.txt"))).toBe(false)

    // renamed, and mode only
    expect(yield* run("mv old.txt new-name.txt && chmod 755 mode.sh && echo ok")).toContain("ok")
    const moved = yield* Repo.diff(connection)
    expect(moved).toContain("rename from old.txt")
    expect(moved).toContain("rename to new-name.txt")
    expect(moved).toContain("old mode 100644\nnew mode 100755")
    expect(fs.statSync(path.join(applyToCopy(source, moved), "mode.sh")).mode & 0o111).not.toBe(0)

    // an unreadable file: a clear refusal naming it, nothing written; readable again, all well
    if (unreadableRefused) {
      expect(yield* run("chmod 000 keep.txt && echo ok")).toContain("ok")
      const unreadable = yield* Effect.flip(Repo.diff(connection))
      expect(unreadable._tag).toBe("TransferFailed")
      expect(unreadable.message).toContain("keep.txt")
      expect(yield* run("chmod 644 keep.txt && echo ok")).toContain("ok")
    }
    expect(yield* Repo.diff(connection, { stat: true })).toContain("new-name.txt")

    // a .git the guest wrote (a config that runs a command in the next `git status`, a hook, a
    // nested repository, a `.git` file): never out with cp, not in a diff, unless asked by name
    expect(
      yield* run(
        [
          "mkdir -p .git/hooks sub/.git",
          "printf '[core]\\n\\tfsmonitor = touch /tmp/pwned\\n' > .git/config",
          "printf '#!/bin/sh\\ntouch /tmp/pwned\\n' > .git/hooks/pre-commit && chmod 755 .git/hooks/pre-commit",
          "printf '[core]\\n\\tfsmonitor = touch /tmp/pwned\\n' > sub/.git/config",
          "mkdir -p other && echo 'gitdir: /tmp' > other/.git && echo work > sub/work.txt",
          "echo ok"
        ].join(" && ")
      )
    ).toContain("ok")
    const noGit = path.join(tempDir("abox-matrix-cp-"), "tree")
    yield* Repo.copyOut(connection, ".", noGit)
    expect(fs.readFileSync(path.join(noGit, "sub", "work.txt"), "utf8")).toBe("work\n")
    expect(fs.existsSync(path.join(noGit, ".git"))).toBe(false)
    expect(fs.existsSync(path.join(noGit, "sub", ".git"))).toBe(false)
    expect(fs.existsSync(path.join(noGit, "other", ".git"))).toBe(false)
    const byName = yield* Effect.flip(Repo.copyOut(connection, ".git", path.join(noGit, "g")))
    expect(byName._tag).toBe("RepoPathInvalid")
    const withGit = path.join(tempDir("abox-matrix-cp-"), "tree")
    yield* Repo.copyOut(connection, ".", withGit, { includeGit: true })
    expect(fs.readFileSync(path.join(withGit, ".git", "config"), "utf8")).toContain("fsmonitor")
    const gitDiff = yield* Repo.diff(connection)
    expect(gitDiff).toContain("sub/work.txt")
    expect(gitDiff).not.toContain(".git/")
    const gitApplied = yield* applied(connection, source)
    expect(fs.existsSync(path.join(gitApplied.target, "sub", ".git"))).toBe(false)
    expect(fs.existsSync(path.join(gitApplied.target, ".git"))).toBe(false)
    expect(gitApplied.paths).not.toContain("sub/.git/config")

    // links out of the copied subtree: refused, though they stay inside the repository
    expect(
      yield* run("mkdir -p a/b/c && echo f > a/b/c/f && ln -s ../../keep.txt a/b/up && ln -s c/f a/b/in && echo ok")
    ).toContain("ok")
    const dest = tempDir("abox-matrix-cp-")
    const up = yield* Effect.flip(Repo.copyOut(connection, "a/b", path.join(dest, "b")))
    expect(up._tag).toBe("ArchiveRefused")
    expect(up.message).toContain("a/b/up")
    expect(fs.readdirSync(dest)).toEqual([])
    expect(yield* run("rm a/b/up && ln -s ../c/f a/b/c/back && echo ok")).toContain("ok")
    yield* Repo.copyOut(connection, "a/b", path.join(dest, "b"))
    expect(fs.readFileSync(path.join(dest, "b", "in"), "utf8")).toBe("f\n")
    expect(fs.readFileSync(path.join(dest, "b", "c", "back"), "utf8")).toBe("f\n")
  })

/**
 * A 100 GB sparse file (it costs the guest nothing): cp and diff refuse it by its declared size
 * at once, naming it, and the guest's tar is stopped instead of reading it to its end.
 */
export const sparseMatrix = (
  connection: GuestConnection,
  run: (command: string) => Effect.Effect<string, unknown>,
  /** look for a tar left running (in a VM: the guest's processes only) */
  checkTar: boolean
) =>
  Effect.gen(function* () {
    expect(yield* run("truncate -s 100G huge.bin && echo ok")).toContain("ok")
    const started = Date.now()
    const dest = tempDir("abox-matrix-cp-")
    const cp = yield* Effect.flip(Repo.copyOut(connection, "huge.bin", path.join(dest, "huge.bin")))
    expect(cp._tag).toBe("ArchiveRefused")
    expect(cp.message).toContain("huge.bin")
    expect(cp.message).toContain("too big")
    const diff = yield* Effect.flip(Repo.diff(connection))
    expect(diff._tag).toBe("ArchiveRefused")
    expect(diff.message).toContain("huge.bin")
    const seconds = (Date.now() - started) / 1000
    // no tar of the guest's is left reading the file
    if (checkTar) expect(yield* run("sleep 1; ps -o pid,args")).not.toMatch(/tar -c/)
    expect(fs.readdirSync(dest)).toEqual([])
    return seconds
  })
