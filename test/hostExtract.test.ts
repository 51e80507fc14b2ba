/**
 * Archives from the guest on the host (src/lib/hostExtract.ts): a hostile guest's tar is refused
 * with ArchiveRefused, and nothing lands outside the target. One test per rule.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { extractTar } from "../src/guest/extract.js"
import { DEFAULT_LIMITS, extractUntrusted, type UntrustedLimits } from "../src/lib/hostExtract.js"
import { fakeTar, type FakeTarEntry, tarHeader } from "./support/fakeTar.js"

const sandbox = () => {
  const root = fs.mkdtempSync(path.join(os.tmpdir(), "abox-host-extract-"))
  const target = path.join(root, "target")
  fs.mkdirSync(path.join(root, "outside"))
  fs.writeFileSync(path.join(root, "outside", "secret"), "original\n")
  return { root, target }
}

const untouched = (root: string) => {
  expect(fs.readdirSync(root).sort()).toEqual(
    ["outside", "target"].filter((n) => fs.existsSync(path.join(root, n)))
  )
  expect(fs.readdirSync(path.join(root, "outside"))).toEqual(["secret"])
  expect(fs.readFileSync(path.join(root, "outside", "secret"), "utf8")).toBe("original\n")
}

const refused = (archive: Uint8Array, limits: UntrustedLimits = DEFAULT_LIMITS) =>
  Effect.gen(function* () {
    const box = sandbox()
    const error = yield* Effect.flip(extractUntrusted(Stream.make(archive), box.target, limits))
    expect(error._tag).toBe("ArchiveRefused")
    untouched(box.root)
    return error.message
  })

const tar = (entries: ReadonlyArray<FakeTarEntry>) => new Uint8Array(fakeTar(entries))

describe("archives from the guest", () => {
  it.effect("a path with `..` is refused", () =>
    Effect.map(refused(tar([{ path: "../outside/secret", data: "pwned\n" }])), (m) =>
      expect(m).toContain("'..'")
    )
  )

  it.effect("an absolute path is refused", () =>
    Effect.map(refused(tar([{ path: "/tmp/abox-pwned", data: "pwned\n" }])), (m) =>
      expect(m).toContain("absolute path")
    )
  )

  it.effect("a write through a symlink is refused (link to outside, then a file under it)", () =>
    Effect.map(
      refused(
        tar([
          { path: "escape", type: "2", linkpath: "../outside" },
          { path: "escape/secret", data: "pwned\n" }
        ])
      ),
      (m) => expect(m).toContain("symbolic link")
    )
  )

  it.effect("cp: a link pointing out of the tree is refused (absolute and relative)", () =>
    Effect.gen(function* () {
      const cp = { ...DEFAULT_LIMITS, linksInside: true }
      expect(yield* refused(tar([{ path: "l", type: "2", linkpath: "/etc/passwd" }]), cp)).toContain(
        "points outside"
      )
      expect(
        yield* refused(
          tar([
            { path: "d/", type: "5" },
            { path: "d/l", type: "2", linkpath: "../../x" }
          ]),
          cp
        )
      ).toContain("points outside")
      // inside is fine
      const box = sandbox()
      yield* extractUntrusted(
        Stream.make(
          tar([
            { path: "d/", type: "5" },
            { path: "d/f", data: "x" },
            { path: "d/l", type: "2", linkpath: "../d/f" }
          ])
        ),
        box.target,
        cp
      )
      expect(fs.readlinkSync(path.join(box.target, "d", "l"))).toBe("../d/f")
    })
  )

  it.effect("the refusal quotes the guest's names without their control characters", () =>
    Effect.map(refused(tar([{ path: "\u001b[2J\u009b31m/../../x", data: "x" }])), (m) => {
      expect(m).toContain("'..'")
      expect(m).not.toMatch(/[\u0000-\u001f\u007f-\u009f]/)
    })
  )

  it.effect("a device file is refused", () =>
    Effect.map(refused(tar([{ path: "null", type: "3" }])), (m) => expect(m).toContain("CharacterDevice"))
  )

  it.effect("a FIFO is refused", () =>
    Effect.map(refused(tar([{ path: "pipe", type: "6" }])), (m) => expect(m).toContain("FIFO"))
  )

  it.effect("a huge size is refused from its header, before any byte is written", () =>
    Effect.gen(function* () {
      // a header claiming 4 GiB (a ustar size field holds < 8 GiB) with no data behind it
      const header = tarHeader({ path: "huge.bin" }, 4 * 1024 * 1024 * 1024)
      const message = yield* refused(new Uint8Array(Buffer.concat([header, Buffer.alloc(1024)])), {
        ...DEFAULT_LIMITS,
        maxBytes: 1024 * 1024 * 1024
      })
      expect(message).toContain("bytes in all")
    })
  )

  it.effect("more entries than the bound are refused", () =>
    Effect.gen(function* () {
      const entries = Array.from({ length: 20 }, (_, i) => ({ path: `f${i}`, data: "x" }))
      const message = yield* refused(tar(entries), { ...DEFAULT_LIMITS, maxEntries: 10 })
      expect(message).toContain("more than 10 entries")
    })
  )

  it.effect("the stream's own failure wins over the extractor's", () =>
    Effect.gen(function* () {
      const box = sandbox()
      const error = yield* Effect.flip(
        extractUntrusted(
          Stream.concat(
            Stream.make(tar([{ path: "a", data: "x" }]).subarray(0, 600)),
            Stream.fail("gone" as const)
          ),
          box.target
        )
      )
      expect(error).toBe("gone")
    })
  )
})

describe("names", () => {
  it("a backslash is part of a name, not a separator (guest and host alike)", async () => {
    const box = sandbox()
    await extractTar(
      (async function* () {
        yield tar([
          { path: "a\\b.txt", data: "one file\n" },
          { path: "dir\\", type: "5" }
        ])
      })(),
      box.target
    )
    expect(fs.readdirSync(box.target).sort()).toEqual(["a\\b.txt", "dir\\"])
    expect(fs.readFileSync(path.join(box.target, "a\\b.txt"), "utf8")).toBe("one file\n")
  })
})
