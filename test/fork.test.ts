/**
 * Fork of a stopped session through the programs (FakeVmm with a qcow2 root, a real registered
 * image, the real store and lock, real qemu-img and qemu-io): the parent's disk becomes a frozen
 * layer that parent and fork both read; each writes its own overlay; `rm` of the parent is
 * refused naming the fork (SessionHasForks), `--force` rebases the fork off it (the data kept);
 * a fork's name is refused when taken; gc removes a frozen layer nothing reads.
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { execFileSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { HttpsBrokerLive } from "../src/broker/HttpsBrokerLive.js"
import * as FakeVmm from "../src/layers/FakeVmm.js"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { ImagesLive } from "../src/layers/ImagesLive.js"
import { RuntimeLockLive } from "../src/layers/RuntimeLockLive.js"
import { SessionStoreLive } from "../src/layers/SessionStoreLive.js"
import { registerImage } from "../src/lib/images.js"
import { open, resume } from "../src/programs/session.js"
import { fork } from "../src/programs/fork.js"
import { remove } from "../src/programs/remove.js"
import { gc } from "../src/programs/gc.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { SessionStore } from "../src/services/SessionStore.js"

const qemuImg = ["/usr/bin/qemu-img", "/usr/local/bin/qemu-img"].find((f) => fs.existsSync(f))
const tempDir = (prefix: string) => fs.mkdtempSync(path.join(os.tmpdir(), prefix))

const layerFor = (home: string) =>
  Layer.mergeAll(
    SessionStoreLive,
    RuntimeLockLive,
    GuestRpcLive,
    HttpsBrokerLive,
    FakeVmm.layerWith({ rootDiskFormat: "qcow2" }),
    ImagesLive
  ).pipe(
    Layer.provideMerge(aboxPathsAt(home)),
    Layer.provideMerge(NodeCommandExecutor.layer),
    Layer.provideMerge(NodeFileSystem.layer)
  )

/** a registered image whose golden root.raw holds 4 MiB of data in a 64 MiB disk */
const registerGolden = (home: string) => {
  const imagesDir = path.join(home, "images")
  fs.mkdirSync(imagesDir, { recursive: true })
  const staging = fs.mkdtempSync(path.join(imagesDir, ".build-"))
  fs.writeFileSync(path.join(staging, "vmlinuz"), "kernel bytes")
  fs.writeFileSync(path.join(staging, "initrd.gz"), "initrd bytes")
  const root = path.join(staging, "root.raw")
  fs.writeFileSync(root, Buffer.alloc(4 * 1024 * 1024, 0x5a))
  fs.truncateSync(root, 64 * 1024 * 1024)
  return registerImage(
    imagesDir,
    staging,
    {
      name: "abox",
      variant: "small",
      arch: process.arch === "arm64" ? "aarch64" : "x86_64",
      kernel: "6.1.0-test",
      node: "20.20.2",
      agent: "a".repeat(64),
      protocol: 4
    },
    { makeDefault: true }
  )
}


const qemuIo = ["/usr/bin/qemu-io", "/usr/local/bin/qemu-io"].find((f) => fs.existsSync(f))
const info = (file: string) =>
  JSON.parse(execFileSync(qemuImg!, ["info", "--output=json", "-U", file], { encoding: "utf8" })) as {
    "backing-filename"?: string
  }
/** qemu-io on a qcow2 file: `write -P <byte> <offset> <len>` or `read -P …` (fails on other bytes) */
const io = (file: string, command: string) =>
  execFileSync(qemuIo!, ["-f", "qcow2", "-c", command, file], { encoding: "utf8" })
const reads = (file: string, command: string) => !/Pattern verification failed/.test(io(file, command))

describe.skipIf(qemuImg === undefined || qemuIo === undefined || process.platform !== "linux")(
  "fork of a stopped session (FakeVmm, qcow2)",
  () => {
    it.live("frozen layer shared, overlays apart; rm refused, --force rebases the fork; gc", () => {
      const home = tempDir("abox-fork-")
      const source = tempDir("abox-fork-src-")
      fs.writeFileSync(path.join(source, "README.md"), "# fork\n")
      return Effect.gen(function* () {
        const image = yield* registerGolden(home)
        const store = yield* SessionStore
        const parent = yield* Effect.scoped(
          Effect.map(open({ source, name: "p" }), (s) => ({ id: s.id, dir: s.dir }))
        )
        const parentRoot = path.join(parent.dir, "root.qcow2")
        io(parentRoot, "write -P 0x11 0 64k")

        const child = yield* fork("p", { name: "c" })
        const childDir = path.join(home, "sessions", child.id)
        const frozen = path.join(parent.dir, "root.frozen-1.qcow2")
        expect(child.fork).toMatchObject({ parent: parent.id, parentName: "p", root: frozen, from: "stopped" })
        expect(child.rootDisk).toEqual({ format: "qcow2", kind: "overlay", backing: image.meta.digest })
        expect(info(parentRoot)["backing-filename"]).toBe(frozen)
        expect(info(path.join(childDir, "root.qcow2"))["backing-filename"]).toBe(frozen)
        expect(info(frozen)["backing-filename"]).toBe(path.join(image.dir, "root.raw"))
        expect((yield* Effect.flip(fork("p", { name: "c" })))._tag).toBe("NameTaken")

        // apart from here: each writes its own overlay, the frozen layer stays
        io(parentRoot, "write -P 0x22 64k 64k")
        io(path.join(childDir, "root.qcow2"), "write -P 0x33 64k 64k")
        expect(reads(path.join(childDir, "root.qcow2"), "read -P 0x11 0 64k")).toBe(true)
        expect(reads(path.join(childDir, "root.qcow2"), "read -P 0x33 64k 64k")).toBe(true)
        expect(reads(parentRoot, "read -P 0x22 64k 64k")).toBe(true)
        // the fork boots (FakeVmm) from its own disk
        yield* Effect.scoped(resume("c"))

        const refused = yield* Effect.flip(remove(["p"]))
        expect(refused._tag).toBe("SessionHasForks")
        if (refused._tag === "SessionHasForks") expect(refused.forks).toEqual([child.id])
        expect(fs.existsSync(parent.dir)).toBe(true)

        yield* remove(["p"], () => Effect.void, { force: true })
        expect(fs.existsSync(parent.dir)).toBe(false)
        const childRoot = path.join(childDir, "root.qcow2")
        expect(info(childRoot)["backing-filename"]).toBe(path.join(image.dir, "root.raw"))
        expect(reads(childRoot, "read -P 0x11 0 64k")).toBe(true)
        expect(reads(childRoot, "read -P 0x33 64k 64k")).toBe(true)
        yield* Effect.scoped(resume("c"))
        expect((yield* store.get(child.id)).fork?.parent).toBe(parent.id)

        // a frozen link nothing reads (a fork that crashed before its overlay): gc removes it
        const leftover = path.join(childDir, "root.frozen-7.qcow2")
        fs.linkSync(childRoot, leftover)
        const actions = yield* gc({ dryRun: false })
        expect(actions.filter((a) => a.kind === "frozen-layer").map((a) => a.target)).toEqual([leftover])
        expect(fs.existsSync(leftover)).toBe(false)
        expect(fs.existsSync(childRoot)).toBe(true)
      }).pipe(Effect.provide(layerFor(home)))
    })
  }
)
