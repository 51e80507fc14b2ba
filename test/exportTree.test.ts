/**
 * The guest's export (src/guest/exportTree.ts) with the tars it runs: busybox's (the images':
 * no -T, so every name goes in argv, in batches) and GNU's (FakeVmm). Many names, a name with a
 * newline, and no name at all each make one valid archive that the checked extractor reads.
 */
import { describe, expect, it } from "@effect/vitest"
import { execFileSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { changedEntries, exportTar } from "../src/guest/exportTree.js"
import { extractTar } from "../src/guest/extract.js"

const busybox = (() => {
  try {
    execFileSync("busybox", ["tar", "--help"], { stdio: "ignore" })
    return true
  } catch {
    return false
  }
})()

/** PATH with `tar` as busybox's, when `which` is "busybox" */
const pathFor = (which: "gnu" | "busybox") => {
  if (which === "gnu") return process.env.PATH ?? ""
  const bin = fs.mkdtempSync(path.join(os.tmpdir(), "abox-busybox-tar-"))
  fs.symlinkSync(execFileSync("sh", ["-c", "command -v busybox"], { encoding: "utf8" }).trim(), path.join(bin, "tar"))
  return `${bin}:${process.env.PATH ?? ""}`
}

const archiveOf = async (dir: string, operands: ReadonlyArray<string>, which: "gnu" | "busybox") => {
  const saved = process.env.PATH
  process.env.PATH = pathFor(which)
  try {
    const chunks: Array<Buffer> = []
    const bytes = await exportTar(dir, operands, {
      write: async (chunk) => void chunks.push(Buffer.from(chunk)),
      end: async () => undefined
    })
    const archive = Buffer.concat(chunks)
    expect(archive.length).toBe(bytes)
    return archive
  } finally {
    process.env.PATH = saved
  }
}

const extract = async (archive: Buffer) => {
  const target = fs.mkdtempSync(path.join(os.tmpdir(), "abox-export-x-"))
  const result = await extractTar(
    (async function* () {
      yield archive
    })(),
    target,
    { untrusted: { maxBytes: 1 << 30, maxEntries: 100_000 } }
  )
  return { target, result }
}

describe.each(["gnu", ...(busybox ? ["busybox" as const] : [])] as const)("exportTar with %s tar", (which) => {
  it("many names (past one argv batch) and a name with a newline: one archive of them all", async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-export-src-"))
    const operands: Array<string> = []
    for (let i = 0; i < 2500; i++) {
      const name = `a-file-with-a-long-enough-name-to-fill-the-batches-${i}.txt`
      fs.writeFileSync(path.join(dir, name), "x".repeat(i % 700))
      operands.push(`./${name}`)
    }
    fs.mkdirSync(path.join(dir, "sub"))
    fs.writeFileSync(path.join(dir, "sub", "new\nline"), "nl")
    operands.push("./sub/new\nline")
    const { target, result } = await extract(await archiveOf(dir, operands, which))
    expect(result.files).toBe(2501)
    expect(fs.readFileSync(path.join(target, "sub", "new\nline"), "utf8")).toBe("nl")
    expect(fs.readFileSync(path.join(target, "a-file-with-a-long-enough-name-to-fill-the-batches-699.txt"), "utf8")).toBe(
      "x".repeat(699)
    )
  })

  it("no name: the archive of nothing, which reads as an empty archive", async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-export-src-"))
    const archive = await archiveOf(dir, [], which)
    expect(archive.length).toBe(1024)
    expect((await extract(archive)).result.files).toBe(0)
  })
})

describe("changedEntries", () => {
  it("only added, only deleted, or nothing: each side's list, empty where nothing is", async () => {
    const repo = fs.mkdtempSync(path.join(os.tmpdir(), "abox-export-repo-"))
    const base = fs.mkdtempSync(path.join(os.tmpdir(), "abox-export-base-"))
    for (const dir of [repo, base]) {
      fs.mkdirSync(path.join(dir, ".git"))
      fs.writeFileSync(path.join(dir, ".git", "HEAD"), "x")
    }
    expect(await changedEntries(repo, base, [".git"])).toEqual({ repo: [], baseline: [] })
    fs.mkdirSync(path.join(repo, "d"))
    fs.writeFileSync(path.join(repo, "d", "new.txt"), "x")
    fs.writeFileSync(path.join(repo, ".git", "config"), "x")
    expect(await changedEntries(repo, base, [".git"])).toEqual({ repo: ["./d/new.txt"], baseline: [] })
    fs.writeFileSync(path.join(base, "gone.txt"), "x")
    expect(await changedEntries(repo, base, [".git"])).toEqual({ repo: ["./d/new.txt"], baseline: ["./gone.txt"] })
  })
})
