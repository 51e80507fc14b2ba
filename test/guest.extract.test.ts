/**
 * Safe tar extraction (src/guest/extract.ts) with hostile archives built in the test: nothing may
 * land outside the repo dir, links are recreated and never followed, special files are skipped.
 */
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { describe, expect, it } from "@effect/vitest"
import * as fc from "fast-check"
import { ExtractError, extractTar, safeComponents, WRITE_AHEAD } from "../src/guest/extract.js"
import { chunked, fakeTar, type FakeTarEntry } from "./support/fakeTar.js"

const isRoot = typeof process.getuid === "function" && process.getuid() === 0

/** a sandbox: <root>/repo is the target, <root>/outside must stay untouched */
const sandbox = () => {
  const root = fs.mkdtempSync(path.join(os.tmpdir(), "abox-extract-"))
  const repo = path.join(root, "repo")
  const outside = path.join(root, "outside")
  fs.mkdirSync(outside)
  fs.writeFileSync(path.join(outside, "secret"), "original\n")
  return { root, repo, outside }
}

const listTree = (dir: string): Array<string> =>
  fs.readdirSync(dir, { recursive: true, encoding: "utf8" }).sort()

const extract = (entries: ReadonlyArray<FakeTarEntry>, repo: string) =>
  extractTar(chunked(fakeTar(entries)), repo)

const expectRefused = async (entries: ReadonlyArray<FakeTarEntry>, pattern: RegExp) => {
  const box = sandbox()
  const error = await extract(entries, box.repo).then(
    () => undefined,
    (e: unknown) => e
  )
  expect(error).toBeInstanceOf(ExtractError)
  expect((error as ExtractError).reason).toMatch(pattern)
  expect(listTree(box.outside)).toEqual(["secret"])
  expect(fs.readFileSync(path.join(box.outside, "secret"), "utf8")).toBe("original\n")
  expect(fs.readdirSync(box.root).sort()).toEqual(["outside", "repo"])
  return box
}

describe("guest tar extraction", () => {
  it("extracts files, dirs, symlinks (as links) and hard links, keeping permission bits only", async () => {
    const box = sandbox()
    const result = await extract(
      [
        { path: "./", type: "5" },
        { path: "dir/", type: "5", mode: 0o750 },
        { path: "dir/tool", data: "#!/bin/sh\n", mode: 0o4755 },
        { path: "dir/data.txt", data: "x".repeat(5000) },
        { path: "up", type: "2", linkpath: "../outside/secret" },
        { path: "abs", type: "2", linkpath: "/etc/passwd" },
        { path: "same", type: "1", linkpath: "dir/data.txt" }
      ],
      box.repo
    )
    expect(result).toEqual({ files: 5, bytes: 5010, skipped: 0 })
    expect(fs.statSync(path.join(box.repo, "dir")).mode & 0o7777).toBe(0o750)
    expect(fs.statSync(path.join(box.repo, "dir/tool")).mode & 0o7777).toBe(0o755)
    expect(fs.readlinkSync(path.join(box.repo, "up"))).toBe("../outside/secret")
    expect(fs.readlinkSync(path.join(box.repo, "abs"))).toBe("/etc/passwd")
    expect(fs.statSync(path.join(box.repo, "same")).ino).toBe(
      fs.statSync(path.join(box.repo, "dir/data.txt")).ino
    )
    expect(fs.readFileSync(path.join(box.outside, "secret"), "utf8")).toBe("original\n")
  })

  it("refuses a sender that goes on past the archive's end; a record's padding is taken", async () => {
    const padded = sandbox()
    const archive = fakeTar([{ path: "a.txt", data: "a\n" }])
    await extractTar(chunked(Buffer.concat([archive, Buffer.alloc(10240)])), padded.repo)
    expect(fs.readFileSync(path.join(padded.repo, "a.txt"), "utf8")).toBe("a\n")
    const endless = sandbox()
    async function* forever(): AsyncGenerator<Uint8Array> {
      yield archive
      for (;;) yield Buffer.alloc(64 * 1024)
    }
    const error = await extractTar(forever(), endless.repo).then(
      () => undefined,
      (e: unknown) => e
    )
    expect(error).toBeInstanceOf(ExtractError)
    expect((error as ExtractError).reason).toMatch(/after the archive's end/)
  })

  it("refuses absolute paths", () => expectRefused([{ path: "/tmp/abox-evil", data: "x" }], /absolute/))

  it("refuses '..' anywhere in a path", async () => {
    await expectRefused([{ path: "../outside/secret", data: "pwned" }], /\.\./)
    await expectRefused([{ path: "a/../../outside/secret", data: "pwned" }], /\.\./)
  })

  it("refuses a file through a symlink entry (symlink-then-file)", async () => {
    const box = await expectRefused(
      [
        { path: "link", type: "2", linkpath: "../outside" },
        { path: "link/secret", data: "pwned" }
      ],
      /symbolic link/
    )
    expect(fs.readlinkSync(path.join(box.repo, "link"))).toBe("../outside")
  })

  it("refuses a directory entry through a symlink, and a deeper path through one", async () => {
    await expectRefused(
      [
        { path: "d", type: "2", linkpath: "/" },
        { path: "d/tmp/x/", type: "5" }
      ],
      /symbolic link/
    )
  })

  it("replaces a symlink with a file instead of writing through it", async () => {
    const box = sandbox()
    await extract(
      [
        { path: "s", type: "2", linkpath: "../outside/secret" },
        { path: "s", data: "new content" }
      ],
      box.repo
    )
    expect(fs.lstatSync(path.join(box.repo, "s")).isFile()).toBe(true)
    expect(fs.readFileSync(path.join(box.repo, "s"), "utf8")).toBe("new content")
    expect(fs.readFileSync(path.join(box.outside, "secret"), "utf8")).toBe("original\n")
  })

  it("refuses hard links that point outside or at a symlink", async () => {
    await expectRefused([{ path: "h", type: "1", linkpath: "../outside/secret" }], /hard link/)
    await expectRefused([{ path: "h", type: "1", linkpath: "/etc/passwd" }], /hard link/)
    await expectRefused(
      [
        { path: "s", type: "2", linkpath: "../outside/secret" },
        { path: "h", type: "1", linkpath: "s" }
      ],
      /hard link/
    )
    await expectRefused(
      [
        { path: "d", type: "2", linkpath: "../outside" },
        { path: "h", type: "1", linkpath: "d/secret" }
      ],
      /symbolic link/
    )
  })

  it("skips devices and FIFOs", async () => {
    const box = sandbox()
    const result = await extract(
      [
        { path: "tty", type: "3" },
        { path: "fifo", type: "6" },
        { path: "ok", data: "fine" }
      ],
      box.repo
    )
    expect(result).toEqual({ files: 1, bytes: 4, skipped: 2 })
    expect(listTree(box.repo)).toEqual(["ok"])
  })

  it("fails on a damaged archive (bad checksum, truncated, not a tar) without a hang", async () => {
    const box = sandbox()
    const good = fakeTar([{ path: "f", data: "y".repeat(3000) }])
    const badChecksum = Buffer.from(good)
    badChecksum[0] = "g".charCodeAt(0)
    await expect(extractTar(chunked(badChecksum), box.repo)).rejects.toBeInstanceOf(ExtractError)
    await expect(extractTar(chunked(good.subarray(0, 1500)), box.repo)).rejects.toBeInstanceOf(ExtractError)
    await expect(extractTar(chunked(Buffer.from("hello, not a tar")), box.repo)).rejects.toBeInstanceOf(
      ExtractError
    )
  })

  it.skipIf(!isRoot)("hands everything to the unprivileged owner (root only)", async () => {
    const box = sandbox()
    await extractTar(
      chunked(
        fakeTar([
          { path: "d/", type: "5" },
          { path: "d/f", data: "z" },
          { path: "l", type: "2", linkpath: "d/f" }
        ])
      ),
      box.repo,
      { owner: { uid: 65534, gid: 65534 } }
    )
    for (const name of ["", "d", "d/f", "l"]) {
      const stat = fs.lstatSync(path.join(box.repo, name))
      expect([name, stat.uid, stat.gid]).toEqual([name, 65534, 65534])
    }
  })

  it("safeComponents: property: an accepted path never leaves the root", () => {
    const segment = fc.constantFrom("a", "b", "..", ".", "", "c.txt", "/", "\\")
    fc.assert(
      fc.property(fc.array(segment, { maxLength: 8 }), (segments) => {
        const entryPath = segments.join("/")
        const parts = safeComponents(entryPath)
        if (typeof parts === "string") return
        const resolved = path.resolve("/repo", ...parts)
        expect(resolved === "/repo" || resolved.startsWith("/repo/")).toBe(true)
      }),
      { numRuns: 500 }
    )
  })

  it("property: content survives any chunking (unaligned, tiny, several write batches per file)", async () => {
    // bigger than WRITE_AHEAD, so that a file is written in several batches and its entry pauses
    const big = Buffer.alloc(WRITE_AHEAD * 2 + 777)
    for (let i = 0; i < big.length; i++) big[i] = (i * 7 + (i >> 11)) & 0xff
    const archive = fakeTar([
      { path: "d/", type: "5" },
      { path: "d/big.bin", data: big },
      { path: "d/small.txt", data: "s".repeat(513) },
      { path: "empty", data: "" }
    ])
    await fc.assert(
      fc.asyncProperty(
        fc.array(fc.integer({ min: 1, max: 200_000 }), { minLength: 1, maxLength: 20 }),
        async (sizes) => {
          const box = sandbox()
          async function* pieces() {
            let offset = 0
            for (let k = 0; offset < archive.length; k++) {
              const size = sizes[k % sizes.length]!
              yield archive.subarray(offset, offset + size)
              offset += size
            }
          }
          const result = await extractTar(pieces(), box.repo)
          expect(result).toEqual({ files: 3, bytes: big.length + 513, skipped: 0 })
          expect(fs.readFileSync(path.join(box.repo, "d", "big.bin")).equals(big)).toBe(true)
          expect(fs.readFileSync(path.join(box.repo, "d", "small.txt"), "utf8")).toBe("s".repeat(513))
          expect(fs.statSync(path.join(box.repo, "empty")).size).toBe(0)
          fs.rmSync(box.root, { recursive: true, force: true })
        }
      ),
      { numRuns: 15 }
    )
  })

  it("property: any archive of files/dirs/links over hostile names writes nothing outside", async () => {
    const name = fc.constantFrom("a", "b", "..", "/tmp", "link", "a/b", "../outside", "link/x")
    const entry: fc.Arbitrary<FakeTarEntry> = fc.oneof(
      fc.record({ path: name, data: fc.constant("p") }),
      fc.record({ path: name, type: fc.constant("5" as const) }),
      fc.record({
        path: name,
        type: fc.constant("2" as const),
        linkpath: fc.constantFrom("../outside", "/", "a", "..")
      }),
      fc.record({ path: name, type: fc.constant("1" as const), linkpath: name })
    )
    await fc.assert(
      fc.asyncProperty(fc.array(entry, { minLength: 1, maxLength: 6 }), async (entries) => {
        const box = sandbox()
        await extract(entries, box.repo).catch((error: unknown) => {
          if (!(error instanceof ExtractError)) throw error
        })
        expect(listTree(box.outside)).toEqual(["secret"])
        expect(fs.readFileSync(path.join(box.outside, "secret"), "utf8")).toBe("original\n")
        expect(fs.readdirSync(box.root).sort()).toEqual(["outside", "repo"])
        expect(fs.existsSync("/tmp/abox-evil")).toBe(false)
        fs.rmSync(box.root, { recursive: true, force: true })
      }),
      { numRuns: 60 }
    )
  })
})
