/**
 * The repository in and out of a real VM (QEMU, real kernel, real guest agent), in one boot plus
 * one for the stopped-session path: Open builds the repository disks on the host (no tar into
 * the guest); an agent-like turn edits, adds, deletes, renames, chmods and writes binary files;
 * `diff | git apply` on a clean copy of the source equals the guest's tree byte for byte;
 * `apply` refuses a changed source; cp both ways; then, stopped, the session boots again for a
 * diff, its work still on its own disks. (Sparse files and free space: test/repoDisk.test.ts,
 * without a VM.)
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { GuestRpcLive } from "../src/layers/GuestRpcLive.js"
import { HttpsBrokerLive } from "../src/broker/HttpsBrokerLive.js"
import { QemuVmmLive } from "../src/layers/QemuVmm.js"
import { RuntimeLockLive } from "../src/layers/RuntimeLockLive.js"
import { SessionStoreLive } from "../src/layers/SessionStoreLive.js"
import { extractUntrusted } from "../src/lib/hostExtract.js"
import { ImagesLive } from "../src/layers/ImagesLive.js"
import * as Repo from "../src/programs/repo.js"
import { open } from "../src/programs/session.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { ensureTestImage, runTurn, testHome, vmSkipReason } from "./e2e-vm-image.js"
import { AGENT_TURN, applyToCopy, manifest, sourceRepo, withoutEmptyDirs } from "./support/trees.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e-repo-vm: skipped: ${skip}`)

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

const t0 = Date.now()
/** where a slow run spends its time (stderr) */
const step = (label: string) =>
  Effect.sync(() => console.error(`e2e-repo-vm: ${((Date.now() - t0) / 1000).toFixed(1)} s ${label}`))

describe.skipIf(skip !== undefined)("repository in and out of a real VM", () => {
  it.live(
    "open via a symlinked source (repository disks) → agent turn → diff | git apply = guest tree; apply refuses a changed source; cp; a stopped session boots for its diff",
    () => {
      const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-repo-vm-"))
      return Effect.gen(function* () {
        yield* Effect.promise(() => ensureTestImage())
        fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
        const source = sourceRepo()
        // the source path is itself a symlink: resolved once
        const link = path.join(home, "source-link")
        fs.symlinkSync(source, link)

        const id = yield* Effect.scoped(
          Effect.gen(function* () {
            yield* step("open")
            const session = yield* open({ source: link, memoryMiB: 512 })
            expect(session.meta.source).toBe(fs.realpathSync(source))
            expect(session.hello.repoDisk).toBe(true)
            expect(fs.existsSync(path.join(session.dir, "repo-base.raw"))).toBe(true)
            expect(fs.existsSync(path.join(session.dir, "repo.qcow2"))).toBe(true)

            const facts = yield* runTurn(
              session.connection,
              "stat -c '%u:%g %a %n' . run.sh 'back\\slash.txt' empty-dir; readlink outside-link; ls -a; mount | grep /work/repo"
            )
            expect(facts).toContain("1000:1000 755 .")
            expect(facts).toContain("1000:1000 644 run.sh")
            expect(facts).toContain("1000:1000 644 back\\slash.txt")
            expect(facts).toContain("1000:1000 755 empty-dir")
            expect(facts).toContain("/etc/hostname")
            expect(facts).not.toContain("lost+found")
            expect(facts).toMatch(/on \/work\/repo type ext4/)

            yield* step("agent turn")
            expect(yield* runTurn(session.connection, AGENT_TURN)).toContain("done")
            const guestTree = fs.mkdtempSync(path.join(os.tmpdir(), "abox-repo-vm-tree-"))
            yield* step("export")
            yield* extractUntrusted(session.connection.exportTree({ tree: "repo", paths: [] }), guestTree)

            yield* step("diff")
            const patch = yield* Repo.diff(session.connection)
            expect(patch).toContain("GIT binary patch")
            expect(patch).toContain("rename from src/old-name.txt")
            expect(patch).toContain("old mode 100644\nnew mode 100755")
            yield* step("git apply")
            const copy = applyToCopy(source, patch)
            expect(withoutEmptyDirs(manifest(copy, [".git"]))).toEqual(
              withoutEmptyDirs(manifest(guestTree, [".git"]))
            )

            // the source changed since the snapshot: refused, with the path
            fs.writeFileSync(path.join(source, "src", "main.c"), "int main(void) { return 1; }\n")
            fs.appendFileSync(path.join(source, "README.md"), "the user's edit\n")
            yield* step("apply")
            const refused = yield* Effect.flip(Repo.apply(session.connection, { to: source }))
            expect(refused._tag).toBe("SourceChanged")
            if (refused._tag === "SourceChanged") expect(refused.paths).toEqual(["README.md"])

            // cp both ways: binary-safe, owned by the repository user in the guest
            const out = fs.mkdtempSync(path.join(os.tmpdir(), "abox-repo-vm-out-"))
            yield* step("cp")
            yield* Repo.copyOut(session.connection, "image.bin", path.join(out, "image.bin"))
            expect(fs.readFileSync(path.join(out, "image.bin"))).toEqual(
              fs.readFileSync(path.join(guestTree, "image.bin"))
            )
            fs.writeFileSync(path.join(out, "payload.bin"), Buffer.from([0, 1, 2, 255]))
            yield* Repo.copyIn(session.connection, path.join(out, "payload.bin"), "src")
            const owner = yield* runTurn(session.connection, "stat -c '%u %s' src/payload.bin")
            expect(owner.trim()).toBe("1000 4")
            return session.id
          })
        )

        // stopped: the session boots again (its own root and repository disks) for the diff
        yield* step("stopped diff")
        const again = yield* Repo.withConnection(id, (connection) => Repo.diff(connection, { stat: true }))
        expect(again).toContain("src/payload.bin")
        expect(again).toContain("src/{old-name.txt => new-name.txt}")
      }).pipe(Effect.provide(layerFor(home)))
    },
    600_000
  )
})
