/**
 * The work out of a real VM (QEMU, the busybox test image, the real guest agent: the export is
 * busybox's tar run as the turn user): the whole matrix of test/support/exportMatrix.ts on one
 * session, a 100 GB sparse file refused at once with the guest's tar stopped, and the built
 * CLI's `abox diff` after `abox run <dir> -- 'echo x > new.txt'` in both homes of a session: a
 * stopped session booted by the command itself, and a detached one through its supervisor.
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { HttpsBrokerLive } from "../src/broker/HttpsBrokerLive.js"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { ImagesLive } from "../src/layers/ImagesLive.js"
import { QemuVmmLive } from "../src/layers/QemuVmm.js"
import { RuntimeLockLive } from "../src/layers/RuntimeLockLive.js"
import { SessionStoreLive } from "../src/layers/SessionStoreLive.js"
import { open } from "../src/programs/session.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { ensureTestImage, repoRoot, runTurn, testHome, vmSkipReason } from "./e2e-vm-image.js"
import { exportMatrix, matrixSource, sparseMatrix } from "./support/exportMatrix.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e-export-vm: skipped: ${skip}`)

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

const newHome = () => {
  const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-export-vm-"))
  // the sessions are this test's own; the golden image is the shared test image
  fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
  return home
}

describe.skipIf(skip !== undefined)("the work out of a real VM", () => {
  it.live(
    "the matrix: nothing, added only (ignored, a newline), deleted only, renamed, mode only, unreadable, a guest's .git, links out of the copied subtree, a 100 GB sparse file",
    () => {
      const home = newHome()
      const source = matrixSource()
      return Effect.gen(function* () {
        yield* Effect.promise(() => ensureTestImage())
        const session = yield* open({ source, memoryMiB: 512 })
        const run = (command: string) => runTurn(session.connection, command)
        yield* exportMatrix(session.connection, source, run, true)
        const seconds = yield* sparseMatrix(session.connection, run, true)
        console.error(`e2e-export-vm: a 100 GB sparse file refused by cp and diff in ${seconds.toFixed(1)} s`)
        expect(seconds).toBeLessThan(60)
      }).pipe(Effect.scoped, Effect.provide(layerFor(home)))
    },
    600_000
  )

  it.live(
    "abox diff after abox run <dir> -- 'echo x > new.txt' prints the new file: stopped (booted for it) and detached (its supervisor)",
    () => {
      const home = newHome()
      const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-export-src-"))
      fs.writeFileSync(path.join(source, "README.md"), "work out\n")
      const cli = path.join(repoRoot, "dist", "abox.js")
      const abox = (args: ReadonlyArray<string>) => {
        const r = spawnSync(process.execPath, [cli, ...args], {
          env: { PATH: process.env.PATH ?? "", HOME: os.homedir(), ABOX_HOME: home },
          encoding: "utf8",
          timeout: 300_000
        })
        return { code: r.status, stdout: r.stdout, stderr: r.stderr }
      }
      return Effect.promise(async () => {
        await ensureTestImage()
        const ran = abox(["run", "--name", "work", source, "--", "echo x > new.txt"])
        expect(ran.code, ran.stderr).toBe(0)
        const stopped = abox(["diff", "work"])
        expect(stopped.code, stopped.stderr).toBe(0)
        expect(stopped.stdout).toContain("diff --git a/new.txt b/new.txt\nnew file mode 100644")
        expect(stopped.stdout).toContain("+x\n")

        const started = abox(["start", "work", "--json"])
        expect(started.code, started.stderr).toBe(0)
        try {
          const detached = abox(["diff", "work"])
          expect(detached.code, detached.stderr).toBe(0)
          expect(detached.stdout).toBe(stopped.stdout)
          // a guest-written .git and a link above the copied directory, through the supervisor
          const planted = abox([
            "exec",
            "work",
            "--",
            "mkdir -p .git d && printf '[core]\\n\\tfsmonitor = touch /tmp/pwned\\n' > .git/config && ln -s ../README.md d/up && truncate -s 100G huge.bin"
          ])
          expect(planted.code, planted.stderr).toBe(0)
          const out = fs.mkdtempSync(path.join(os.tmpdir(), "abox-export-out-"))
          const tree = abox(["cp", "work:.", path.join(out, "tree")])
          expect(tree.code, tree.stderr).toBe(84) // ArchiveRefused: huge.bin is over the 8 GiB of a cp, by its header
          expect(tree.stderr).toContain("huge.bin")
          const link = abox(["cp", "work:d", path.join(out, "d")])
          expect(link.code).toBe(84)
          expect(link.stderr).toContain("points outside what was copied")
          const git = abox(["cp", "work:.git", path.join(out, "g")])
          expect(git.code).toBe(82) // RepoPathInvalid: by name only with --include-git
          expect(git.stderr).toContain("--include-git")
          const withGit = abox(["cp", "--include-git", "work:.git", path.join(out, "g")])
          expect(withGit.code, withGit.stderr).toBe(0)
          expect(withGit.stderr).toContain("warning")
          expect(fs.readFileSync(path.join(out, "g", "config"), "utf8")).toContain("fsmonitor")
        } finally {
          abox(["stop", "work"])
        }
      })
    },
    600_000
  )
})
