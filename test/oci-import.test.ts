/**
 * `abox image import` without a VM: OCI images built here (test/support/oci.ts) in both forms
 * (oci-archive, docker save; plus a layout directory) become golden images whose root.raw
 * (read with debugfs) holds the layers applied in order — the top layer's files, no whited-out
 * file or directory, an opaque directory without its lower contents — with owners, modes
 * (setuid too), hard and symbolic links and a FIFO kept, and abox's runtime under /opt/abox;
 * and each hostile archive is refused (`ImageImportRefused`) with nothing registered and no
 * staging directory left. The boot and the turn are test/e2e-oci-vm.test.ts.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import * as Cause from "effect/Cause"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import { execFileSync, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import * as zlib from "node:zlib"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { findImportedImage, removeImage } from "../src/lib/images.js"
import { importImage, type ImportOptions } from "../src/programs/imageImport.js"
import { ensureTestImage, repoRoot, testHome, vmSkipReason } from "./e2e-vm-image.js"
import { archiveOf, dockerLayout, ociLayout, sampleImage, type TestImage } from "./support/oci.js"
import { fakeTar, type FakeTarEntry } from "./support/fakeTar.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`image import tests skipped: ${skip}`)

let home = ""
let work = ""
let busybox = Buffer.alloc(0)
const images = () => path.join(testHome, "images")

beforeAll(async () => {
  if (skip !== undefined) return
  await ensureTestImage()
  home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-oci-"))
  // the imports go to the shared test image's registry, where their base image is
  fs.symlinkSync(images(), path.join(home, "images"))
  work = fs.mkdtempSync(path.join(os.tmpdir(), "abox-oci-src-"))
  busybox = fs.readFileSync("/usr/bin/busybox")
}, 900_000)
afterAll(() => {
  // what a failed test left registered (a passing one removes its image itself)
  if (home !== "")
    for (const name of ["oci-test", "oci-docker", "oci-dir", "hostile"])
      fs.rmSync(path.join(testHome, "images", name), { recursive: true, force: true })
  if (home !== "") fs.rmSync(home, { recursive: true, force: true })
  if (work !== "") fs.rmSync(work, { recursive: true, force: true })
})

const run = (options: ImportOptions) =>
  Effect.runPromiseExit(importImage(options).pipe(Effect.provide(aboxPathsAt(home)), Effect.provide(NodeContext.layer)))

const write = (name: string, bytes: Buffer) => {
  const file = path.join(work, name)
  fs.writeFileSync(file, bytes)
  return file
}

/** the registry's entries: names, digests, and anything staged */
const registry = () =>
  fs
    .readdirSync(images())
    .flatMap((name) =>
      fs.statSync(path.join(images(), name)).isDirectory() && !name.startsWith(".")
        ? fs.readdirSync(path.join(images(), name)).map((digest) => `${name}/${digest}`)
        : [name]
    )
    .sort()

const debugfs = (disk: string, request: string) =>
  spawnSync("debugfs", ["-R", request, disk], { encoding: "utf8" })

/** what debugfs says of one path in the image's root */
const inode = (disk: string, p: string) => {
  const out = debugfs(disk, `stat "${p}"`).stdout
  if (!/Inode: \d+/.test(out)) return undefined
  return {
    number: Number(/Inode: (\d+)/.exec(out)![1]),
    type: /Type: (\S+)/.exec(out)![1],
    mode: parseInt(/Mode:\s+(\d+)/.exec(out)![1]!, 8),
    uid: Number(/User:\s+(\d+)/.exec(out)![1]),
    gid: Number(/Group:\s+(\d+)/.exec(out)![1]),
    links: Number(/Links: (\d+)/.exec(out)![1]),
    target: /Fast link dest: "(.*)"/.exec(out)?.[1]
  }
}
const cat = (disk: string, p: string) => debugfs(disk, `cat "${p}"`).stdout

const refusedWith = (exit: Exit.Exit<unknown, unknown>) => {
  expect(Exit.isFailure(exit)).toBe(true)
  if (!Exit.isFailure(exit)) return undefined
  const error = Cause.failureOption(exit.cause)
  expect(error._tag).toBe("Some")
  if (error._tag !== "Some") return undefined
  // a plain copy: the error class itself does not print well in a failed comparison
  const value = error.value as { _tag: string; reason?: string; message: string }
  return { _tag: value._tag, reason: value.reason, message: value.message }
}

describe.skipIf(skip !== undefined)("abox image import", () => {
  const checkRoot = (disk: string) => {
    // the top layer's file; the whited-out file and directory absent; the opaque directory holds
    // only the top layer's file
    expect(cat(disk, "/top.txt")).toBe("from the top layer\n")
    expect(inode(disk, "/gone.txt")).toBeUndefined()
    expect(inode(disk, "/dir-gone")).toBeUndefined()
    expect(inode(disk, "/opq/lower.txt")).toBeUndefined()
    expect(cat(disk, "/opq/upper.txt")).toBe("upper\n")
    // owners and modes as the layer says, setuid kept
    expect(inode(disk, "/owned.txt")).toMatchObject({ type: "regular", mode: 0o640, uid: 1234, gid: 2345 })
    expect(inode(disk, "/suid")).toMatchObject({ mode: 0o4755, uid: 0, gid: 0 })
    expect(inode(disk, "/srv")).toMatchObject({ type: "directory", mode: 0o750, uid: 1234, gid: 2345 })
    // a hard link is one inode of two names; a symlink a link
    const hard = inode(disk, "/hard")!
    expect(hard.number).toBe(inode(disk, "/hardsrc")!.number)
    expect(hard.links).toBe(2)
    expect(inode(disk, "/link")).toMatchObject({ type: "symlink", target: "owned.txt" })
    expect(inode(disk, "/fifo")).toMatchObject({ type: "FIFO", mode: 0o600 })
    // abox's runtime, its init, the repository user
    expect(inode(disk, "/opt/abox/abox-guest.js")?.type).toBe("regular")
    expect(inode(disk, "/opt/abox/bin/busybox")?.mode).toBe(0o755)
    expect(cat(disk, "/sbin/init")).toMatch(/^#!\/opt\/abox\/bin\/busybox sh\n/)
    expect(cat(disk, "/etc/passwd")).toBe(
      "root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000:repository owner:/home/agent:/bin/sh\n"
    )
    expect(inode(disk, "/work/repo")).toMatchObject({ uid: 1000, gid: 1000 })
    expect(JSON.parse(cat(disk, "/opt/abox/image-env.json"))).toEqual({
      PATH: "/bin",
      OCI_GREETING: "hello from the image"
    })
  }

  it("imports an oci-archive: layers in order, whiteouts, opaque directories, owners, modes, links", async () => {
    const archive = write("oci.tar", archiveOf(ociLayout(sampleImage(busybox, "oci-test:1"))))
    const exit = await run({ source: archive, name: "oci-test" })
    expect(Exit.isSuccess(exit), String(exit)).toBe(true)
    if (!Exit.isSuccess(exit)) return
    const image = exit.value
    checkRoot(path.join(image.dir, "root.raw"))
    expect(image.meta).toMatchObject({ name: "oci-test", variant: "oci" })
    expect(image.meta.source).toMatchObject({
      kind: "oci",
      format: "oci-archive",
      reference: "docker.io/library/oci-test:1",
      layers: 2,
      env: ["PATH=/bin", "OCI_GREETING=hello from the image"],
      workingDir: "/srv",
      user: "1234"
    })
    // devcontainer `image` references resolve to it, as written or in full
    const found = await Effect.runPromise(findImportedImage(images(), "oci-test:1"))
    expect(found?.meta.digest).toBe(image.meta.digest)
    expect(
      (await Effect.runPromise(findImportedImage(images(), "docker.io/library/oci-test:1")))?.meta.digest
    ).toBe(image.meta.digest)
    expect(await Effect.runPromise(findImportedImage(images(), "oci-test:2"))).toBeUndefined()
    await Effect.runPromise(removeImage(images(), `oci-test@${image.meta.digest}`, false))
  }, 300_000)

  it("imports a docker save archive and an OCI layout directory (dir:tag)", async () => {
    const archive = write("docker.tar", archiveOf(dockerLayout(sampleImage(busybox, "oci-test:docker"))))
    const exit = await run({ source: archive, name: "oci-docker" })
    expect(Exit.isSuccess(exit), String(exit)).toBe(true)
    if (!Exit.isSuccess(exit)) return
    checkRoot(path.join(exit.value.dir, "root.raw"))
    expect(exit.value.meta.source).toMatchObject({
      format: "docker-archive",
      reference: "docker.io/library/oci-test:docker"
    })
    await Effect.runPromise(removeImage(images(), `oci-docker@${exit.value.meta.digest}`, false))

    const dir = path.join(work, "layout")
    for (const [name, bytes] of ociLayout(sampleImage(busybox, "oci-test:dir"))) {
      fs.mkdirSync(path.dirname(path.join(dir, name)), { recursive: true })
      fs.writeFileSync(path.join(dir, name), bytes)
    }
    const fromDir = await run({ source: `${dir}:dir`, name: "oci-dir" })
    expect(Exit.isSuccess(fromDir), String(fromDir)).toBe(true)
    if (!Exit.isSuccess(fromDir)) return
    expect(fromDir.value.meta.source?.format).toBe("oci-layout")
    expect(cat(path.join(fromDir.value.dir, "root.raw"), "/top.txt")).toBe("from the top layer\n")
    await Effect.runPromise(removeImage(images(), `oci-dir@${fromDir.value.meta.digest}`, false))
    // a tag the layout does not have
    expect(refusedWith(await run({ source: `${dir}:nope` }))).toMatchObject({
      _tag: "ImageImportRefused",
      reason: "tag"
    })
  }, 300_000)

  const small = (top: ReadonlyArray<FakeTarEntry>): TestImage => ({
    layers: [
      [
        { path: "bin/", type: "5" },
        { path: "bin/sh", data: "x" }
      ],
      top
    ]
  })
  /** an archive whose blob `hex` is replaced by other bytes (its descriptor unchanged) */
  const tampered = (image: TestImage, pick: (files: Map<string, Buffer>) => string) => {
    const files = ociLayout(image)
    const name = pick(files)
    // one byte changed: the same size, another digest
    const bytes = Buffer.from(files.get(name)!)
    bytes[bytes.length - 1] ^= 0xff
    files.set(name, bytes)
    return files
  }
  const layerBlob = (files: Map<string, Buffer>) => {
    const index = JSON.parse(files.get("index.json")!.toString()) as { manifests: Array<{ digest: string }> }
    const manifest = JSON.parse(
      files.get(`blobs/sha256/${index.manifests[0]!.digest.slice(7)}`)!.toString()
    ) as {
      layers: Array<{ digest: string }>
    }
    return `blobs/sha256/${manifest.layers[1]!.digest.slice(7)}`
  }

  const hostile: ReadonlyArray<{
    readonly name: string
    readonly archive: () => Buffer
    readonly reason: string
    readonly limit?: number
  }> = [
    {
      name: "a layer path with ..",
      archive: () => archiveOf(ociLayout(small([{ path: "../escape", data: "x" }]))),
      reason: "layer"
    },
    {
      name: "an absolute layer path",
      archive: () => archiveOf(ociLayout(small([{ path: "/etc/x", data: "x" }]))),
      reason: "layer"
    },
    {
      name: "a write through a link out of the root",
      archive: () =>
        archiveOf(
          ociLayout(
            small([
              { path: "evil", type: "2", linkpath: "/tmp" },
              { path: "evil/planted", data: "x" }
            ])
          )
        ),
      reason: "layer"
    },
    {
      name: "a device",
      archive: () => archiveOf(ociLayout(small([{ path: "dev-null", type: "3" }]))),
      reason: "layer"
    },
    {
      name: "a declared size over the limit (a size bomb)",
      archive: () =>
        archiveOf(ociLayout(small([{ path: "big", data: "x", declaredSize: 64 * 1024 * 1024 }]))),
      reason: "layer",
      limit: 1024 * 1024
    },
    {
      name: "a blob that does not match its digest",
      archive: () => archiveOf(tampered(small([{ path: "a", data: "x" }]), layerBlob)),
      reason: "digest"
    },
    {
      name: "a layer that does not match its diff_id",
      archive: () =>
        archiveOf(
          ociLayout({
            ...small([{ path: "a", data: "x" }]),
            diffIds: [`sha256:${"0".repeat(64)}`, `sha256:${"1".repeat(64)}`]
          })
        ),
      reason: "digest"
    },
    {
      name: "an archive path with ..",
      archive: () => archiveOf(ociLayout(small([])), [{ path: "../outside", data: "x" }]),
      reason: "archive"
    },
    {
      name: "an archive link out of it",
      archive: () =>
        archiveOf(ociLayout(small([])), [{ path: "blobs/passwd", type: "2", linkpath: "/etc/passwd" }]),
      reason: "archive"
    },
    {
      name: "a FIFO in the archive",
      archive: () => archiveOf(ociLayout(small([])), [{ path: "pipe", type: "6" }]),
      reason: "archive"
    },
    {
      name: "a gzipped archive of endless tar padding (a decompression bomb)",
      archive: () => zlib.gzipSync(Buffer.alloc(100 * 1024 * 1024)),
      reason: "archive",
      limit: 1024 * 1024
    },
    { name: "no image at all", archive: () => fakeTar([{ path: "README", data: "hi" }]), reason: "format" }
  ]

  for (const attack of hostile) {
    it(`refuses ${attack.name}, registering nothing`, async () => {
      const before = registry()
      const exit = await run({
        source: write(`${attack.name.replace(/\W+/g, "-")}.tar`, attack.archive()),
        name: "hostile",
        ...(attack.limit === undefined ? {} : { limits: { maxBytes: attack.limit, maxEntries: 1000 } })
      })
      const error = refusedWith(exit)
      expect(error).toMatchObject({ _tag: "ImageImportRefused", reason: attack.reason })
      expect(registry()).toEqual(before)
      // nothing written outside the staging directory either
      expect(fs.existsSync("/tmp/planted")).toBe(false)
      expect(fs.existsSync(path.join(work, "..", "escape"))).toBe(false)
    }, 120_000)
  }

  it("the CLI: a refused archive is exit code 110 with one line; the limit flag is checked", () => {
    const cli = path.join(repoRoot, "dist", "abox.js")
    const archive = write("cli-hostile.tar", archiveOf(ociLayout(small([{ path: "dev-null", type: "3" }]))))
    const env = { PATH: process.env.PATH ?? "", HOME: os.homedir(), ABOX_HOME: home }
    const r = spawnSync(process.execPath, [cli, "image", "import", archive], { env, encoding: "utf8" })
    expect(r.status, r.stderr).toBe(110)
    expect(r.stderr).toMatch(/^abox: layer 2 of 2 .* CharacterDevice entries are refused\n$/)
    const bad = spawnSync(process.execPath, [cli, "image", "import", archive, "--max-size", "lots"], {
      env,
      encoding: "utf8"
    })
    expect(bad.status).toBe(110)
    expect(bad.stderr).toMatch(/--max-size/)
    execFileSync("true")
  })
})
