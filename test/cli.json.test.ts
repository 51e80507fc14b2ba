/**
 * docs/cli-json.md: every non-streaming `--json` command prints exactly one JSON object on stdout,
 * whose top-level fields name what it carries; `dryRun` sits at the top level wherever the command
 * has `--dry-run`; whatever a command removed is an array named `removed`.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as fs from "node:fs"
import * as path from "node:path"
import { registerImage } from "../src/lib/images.js"
import { buildCli, removeTempHomes, runCli, tempHome, writeSession } from "./cliHelpers.js"

const A = "01aaaaaaaaaaaaaaaaaaaaaaaa"
const B = "01bbbbbbbbbbbbbbbbbbbbbbbb"

beforeAll(buildCli, 120_000)
afterAll(removeTempHomes)

/** exactly one JSON object on stdout, nothing after it */
const one = (args: ReadonlyArray<string>, home: string): Record<string, unknown> => {
  const r = runCli(home, [...args, "--json"], { ABOX_SKIP_SCRUB: "1" })
  expect(r.code, `${args.join(" ")}: ${r.stderr}`).toBe(0)
  const value: unknown = JSON.parse(r.stdout)
  expect(typeof value === "object" && value !== null && !Array.isArray(value)).toBe(true)
  return value as Record<string, unknown>
}

const keys = (value: Record<string, unknown>) => Object.keys(value).sort()

const stageImage = (imagesDir: string, content: string) => {
  fs.mkdirSync(imagesDir, { recursive: true })
  const dir = fs.mkdtempSync(path.join(imagesDir, ".build-"))
  fs.writeFileSync(path.join(dir, "vmlinuz"), `kernel ${content}`)
  fs.writeFileSync(path.join(dir, "initrd.gz"), `initrd ${content}`)
  fs.writeFileSync(path.join(dir, "root.raw"), `root ${content}`)
  return dir
}

describe("--json output: one convention (docs/cli-json.md)", () => {
  it("list, show, gc, scrub, prune, rm, image list, image rm", async () => {
    const home = tempHome()
    const sessions = path.join(home, "sessions")
    writeSession(sessions, A)
    writeSession(sessions, B)

    expect(keys(one(["list"], home))).toEqual(["sessions"])
    expect(keys(one(["show", A], home))).toEqual(["session"])

    for (const dryRun of [true, false]) {
      const flag = dryRun ? ["--dry-run"] : []
      const gc = one(["gc", ...flag], home)
      expect(keys(gc)).toEqual(["actions", "dryRun"])
      expect(gc.dryRun).toBe(dryRun)
      const scrub = one(["scrub", ...flag], home)
      expect(keys(scrub)).toEqual([
        "dryRun",
        "filesScanned",
        "findings",
        "memoryStatesScanned",
        "problems",
        "sessionsScanned"
      ])
      expect(scrub.dryRun).toBe(dryRun)
    }

    const pruneDry = one(["prune", "--dry-run", "--yes"], home)
    expect(keys(pruneDry)).toEqual(["dryRun", "removed", "skipped"])
    expect(pruneDry.dryRun).toBe(true)
    expect(pruneDry.removed).toHaveLength(2)

    const rm = one(["rm", A, "--yes"], home)
    expect(keys(rm)).toEqual(["removed"])
    expect(rm.removed).toMatchObject([{ sessionId: A }])

    const images = path.join(home, "images")
    const image = await Effect.runPromise(
      registerImage(
        images,
        stageImage(images, "one"),
        {
          name: "abox",
          variant: "small",
          arch: "x86_64",
          kernel: "6.1.0-test",
          node: "20.20.2",
          agent: "a".repeat(64),
          protocol: 4
        },
        { makeDefault: true }
      )
    )
    const listed = one(["image", "list"], home)
    expect(keys(listed)).toEqual(["images", "problems"])
    expect(listed.images).toMatchObject([{ digest: image.meta.digest, default: true }])

    const removed = one(["image", "rm", `abox@${image.meta.digest}`, "--force"], home)
    expect(keys(removed)).toEqual(["removed", "standalone"])
    expect(removed.removed).toMatchObject([{ digest: image.meta.digest }])
    expect(fs.existsSync(image.dir)).toBe(false)

    // an error is one `{"error":…}` object on one line, so that it is a JSON line after a stream too
    const missing = runCli(home, ["show", "nope", "--json"], { ABOX_SKIP_SCRUB: "1" })
    expect(missing.stdout.split("\n")).toHaveLength(2)
    expect(keys(JSON.parse(missing.stdout) as Record<string, unknown>)).toEqual(["error"])
  }, 120_000)
})
