/**
 * The agent's work, out, and files in (src/programs/repo.ts) against FakeVmm: the real guest
 * agent as a host process (tar path: the snapshot streamed in, the baseline copied beside it),
 * the real protocol's export channel, host git.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { extractUntrusted } from "../src/lib/hostExtract.js"
import * as Repo from "../src/programs/repo.js"
import { open, type TransferProgress } from "../src/programs/session.js"
import { progressLine } from "../src/cli/progress.js"
import { AGENT_TURN, applyToCopy, manifest, sourceRepo, withoutEmptyDirs } from "./support/trees.js"
import { exportMatrix, matrixSource, sparseMatrix } from "./support/exportMatrix.js"
import { fakeLifecycle } from "./support/fakeLifecycle.js"

const layerFor = (home: string) => fakeLifecycle(home)

const tempDir = (prefix: string) => fs.mkdtempSync(path.join(os.tmpdir(), prefix))

const stdoutOf = (events: ReadonlyArray<{ readonly _tag: string }>) =>
  events
    .map((e) => {
      const ev = e as { _tag: string; event?: { kind: string; data?: string } }
      return ev._tag === "Event" && (ev.event?.kind === "stdout" || ev.event?.kind === "stderr")
        ? ev.event.data
        : ""
    })
    .join("")

describe("diff / apply / cp (FakeVmm)", () => {
  it.live(
    "an agent-like turn, then: diff | git apply on a clean copy = the guest tree; apply refuses a changed source; cp both ways",
    () => {
      const home = tempDir("abox-home-")
      const source = sourceRepo()
      return Effect.gen(function* () {
        const progress: Array<TransferProgress> = []
        const session = yield* open({ source, onProgress: (p) => Effect.sync(() => void progress.push(p)) })
        // the transfer's progress: from nothing to every file and byte of the scan
        expect(progress[0]).toMatchObject({ files: 0, bytes: 0 })
        expect(progress.at(-1)!.files).toBe(progress.at(-1)!.totalFiles)
        expect(progress.at(-1)!.bytes).toBe(progress.at(-1)!.totalBytes)
        expect(progress.at(-1)!.totalFiles).toBe(10)
        expect(progressLine(progress.at(-1)!)).toContain("10/10 files")
        const turn = Array.from(yield* Stream.runCollect(session.turn(AGENT_TURN)))
        expect(stdoutOf(turn)).toContain("done")
        expect(turn.at(-1)).toMatchObject({ _tag: "End", exitCode: 0 })
        const connection = session.connection

        // the guest's tree, as the host sees it through the export channel
        const guestTree = tempDir("abox-guest-tree-")
        yield* extractUntrusted(connection.exportTree({ tree: "repo", paths: [] }), guestTree)
        expect(fs.readlinkSync(path.join(guestTree, "outside-link"))).toBe("/etc/hostname")
        expect(fs.readFileSync(path.join(guestTree, "back\\slash.txt"), "utf8")).toBe(
          "a name with a backslash\n"
        )

        const patch = yield* Repo.diff(connection)
        expect(patch).toContain("diff --git a/README.md b/README.md")
        expect(patch).toContain("rename from src/old-name.txt")
        expect(patch).toContain("deleted file mode 100644")
        expect(patch).toContain("old mode 100644\nnew mode 100755")
        expect(patch).toContain("GIT binary patch")
        expect(patch).toContain("new file mode 120000")
        expect(patch).not.toContain(".git/HEAD")
        const copy = applyToCopy(source, patch)
        expect(withoutEmptyDirs(manifest(copy, [".git"]))).toEqual(
          withoutEmptyDirs(manifest(guestTree, [".git"]))
        )

        const stat = yield* Repo.diff(connection, { stat: true, paths: ["src"] })
        expect(stat).toContain("src/{old-name.txt => new-name.txt}")
        expect(stat).not.toContain("README.md")

        // the source changed where the patch writes: refused, with the path; nothing written
        const target = tempDir("abox-apply-")
        fs.cpSync(source, target, { recursive: true, verbatimSymlinks: true })
        fs.writeFileSync(path.join(target, "README.md"), "the user's own edit\n")
        const refused = yield* Effect.flip(Repo.apply(connection, { to: target }))
        expect(refused._tag).toBe("SourceChanged")
        if (refused._tag === "SourceChanged") expect(refused.paths).toEqual(["README.md"])
        expect(fs.existsSync(path.join(target, "src", "old-name.txt"))).toBe(true)
        // an unchanged copy takes it: --check writes nothing, then apply does
        const clean = tempDir("abox-apply-clean-")
        fs.cpSync(source, clean, { recursive: true, verbatimSymlinks: true })
        yield* Repo.apply(connection, { to: clean, check: true })
        expect(fs.existsSync(path.join(clean, "src", "old-name.txt"))).toBe(true)
        const touched = yield* Repo.apply(connection, { to: clean })
        expect(touched).toContain("src/new-name.txt")
        expect(withoutEmptyDirs(manifest(clean, [".git"]))).toEqual(
          withoutEmptyDirs(manifest(guestTree, [".git"]))
        )

        // cp out: a file (binary-safe) and a directory; cp in: a file and a directory
        const out = tempDir("abox-cp-out-")
        yield* Repo.copyOut(connection, "image.bin", path.join(out, "copy.bin"))
        expect(fs.readFileSync(path.join(out, "copy.bin"))).toEqual(
          fs.readFileSync(path.join(guestTree, "image.bin"))
        )
        yield* Repo.copyOut(connection, "/work/repo/src", out)
        expect(fs.readFileSync(path.join(out, "src", "new.txt"), "utf8")).toBe("brand new\n")
        const existing = yield* Effect.flip(Repo.copyOut(connection, "image.bin", path.join(out, "copy.bin")))
        expect(existing._tag).toBe("RepoPathInvalid")
        const outside = yield* Effect.flip(Repo.copyOut(connection, "../etc/passwd", out))
        expect(outside._tag).toBe("RepoPathInvalid")
        // a link out of the tree is refused on the way out by cp (it is content for diff)
        const linkOut = yield* Effect.flip(Repo.copyOut(connection, "outside-link", path.join(out, "l")))
        expect(linkOut._tag).toBe("ArchiveRefused")

        const inbound = tempDir("abox-cp-in-")
        fs.mkdirSync(path.join(inbound, "assets"))
        fs.writeFileSync(path.join(inbound, "assets", "logo.bin"), Buffer.from([0, 255, 1, 254]))
        yield* Repo.copyIn(connection, path.join(inbound, "assets"), "src")
        yield* Repo.writeFile(connection, "notes/hello.txt", "written from the host\n")
        expect(Buffer.from(yield* Repo.readFile(connection, "src/assets/logo.bin"))).toEqual(
          Buffer.from([0, 255, 1, 254])
        )
        const listing = yield* Repo.listFiles(connection, "notes")
        expect(listing).toEqual([{ path: "notes/hello.txt", type: "file", size: 22, mode: 0o644 }])
        const owner = stdoutOf(
          Array.from(yield* Stream.runCollect(session.turn("cat notes/hello.txt; ls src/assets")))
        )
        expect(owner).toContain("written from the host")
        expect(owner).toContain("logo.bin")
      }).pipe(Effect.scoped, Effect.provide(layerFor(home)))
    },
    120_000
  )
  it.live(
    "the work-out matrix: nothing, added only (ignored, a newline in a name), deleted only, renamed, mode only, a guest's .git, links out of the copied subtree, a 100 GB sparse file",
    () => {
      const home = tempDir("abox-home-")
      const source = matrixSource()
      return Effect.gen(function* () {
        const session = yield* open({ source })
        const run = (command: string) =>
          Stream.runCollect(session.turn(command)).pipe(Effect.map((events) => stdoutOf(Array.from(events))))
        yield* exportMatrix(session.connection, source, run, false)
        yield* sparseMatrix(session.connection, run, false)
      }).pipe(Effect.scoped, Effect.provide(layerFor(home)))
    },
    120_000
  )
  it.live(
    "apply --3way: a change elsewhere in a file merges; the same lines changed both ways leave markers (MergeConflicts)",
    () => {
      const home = tempDir("abox-home-")
      const source = tempDir("abox-3way-src-")
      const lines = Array.from({ length: 20 }, (_, i) => `line ${i + 1}`)
      fs.writeFileSync(path.join(source, "a.txt"), lines.join("\n") + "\n")
      fs.writeFileSync(path.join(source, "b.txt"), "x\ny\nz\n")
      const agentA = lines.map((l, i) => (i === 1 ? "line 2 by the agent" : l))
      const userA = lines.map((l, i) => (i === 18 ? "line 19 by the user" : l))
      const copy = () => {
        const target = tempDir("abox-3way-target-")
        fs.cpSync(source, target, { recursive: true })
        fs.writeFileSync(path.join(target, "a.txt"), userA.join("\n") + "\n")
        return target
      }
      return Effect.gen(function* () {
        const session = yield* open({ source })
        const turn = Array.from(
          yield* Stream.runCollect(
            session.turn(`printf '${agentA.join("\\n")}\\n' > a.txt && printf 'x\\ny agent\\nz\\n' > b.txt`)
          )
        )
        expect(turn.at(-1)).toMatchObject({ _tag: "End", exitCode: 0 })
        const connection = session.connection

        // the user changed a.txt elsewhere: refused without --3way, merged with it
        const clean = copy()
        const refused = yield* Effect.flip(Repo.apply(connection, { to: clean }))
        expect(refused._tag).toBe("SourceChanged")
        const applied = yield* Repo.apply(connection, { to: clean, threeWay: true })
        expect(applied).toEqual(["a.txt", "b.txt"])
        expect(fs.readFileSync(path.join(clean, "a.txt"), "utf8")).toBe(
          lines.map((l, i) => (i === 1 ? agentA[1] : i === 18 ? userA[18] : l)).join("\n") + "\n"
        )
        expect(fs.readFileSync(path.join(clean, "b.txt"), "utf8")).toBe("x\ny agent\nz\n")

        // the user changed b.txt's same line: conflict markers there, a.txt still merged
        const conflicting = copy()
        fs.writeFileSync(path.join(conflicting, "b.txt"), "x\ny user\nz\n")
        const checked = yield* Effect.flip(
          Repo.apply(connection, { to: conflicting, threeWay: true, check: true })
        )
        expect(checked._tag).toBe("MergeConflicts")
        if (checked._tag === "MergeConflicts") expect(checked.paths).toEqual(["b.txt"])
        // --check wrote nothing
        expect(fs.readFileSync(path.join(conflicting, "b.txt"), "utf8")).toBe("x\ny user\nz\n")
        expect(fs.readFileSync(path.join(conflicting, "a.txt"), "utf8")).toBe(userA.join("\n") + "\n")
        const conflicted = yield* Effect.flip(Repo.apply(connection, { to: conflicting, threeWay: true }))
        expect(conflicted._tag).toBe("MergeConflicts")
        if (conflicted._tag === "MergeConflicts") {
          expect(conflicted.paths).toEqual(["b.txt"])
          expect(conflicted.applied).toEqual(["a.txt"])
        }
        const marked = fs.readFileSync(path.join(conflicting, "b.txt"), "utf8")
        expect(marked).toContain("<<<<<<<")
        expect(marked).toContain("y user")
        expect(marked).toContain("y agent")
        expect(fs.readFileSync(path.join(conflicting, "a.txt"), "utf8")).toContain("line 2 by the agent")
        // nothing of git's was left in the target
        expect(fs.existsSync(path.join(conflicting, ".git"))).toBe(false)
      }).pipe(Effect.scoped, Effect.provide(layerFor(home)))
    },
    120_000
  )
})
