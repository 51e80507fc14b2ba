/**
 * Archives from the guest on the host (src/lib/hostExtract.ts): a hostile guest's tar is refused
 * with ArchiveRefused, and nothing lands outside the target. One test per rule.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Stream from "effect/Stream"
import * as TestClock from "effect/TestClock"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { extractTar } from "../src/guest/extract.js"
import {
  DEFAULT_LIMITS,
  EXPORT_IDLE_TIMEOUT,
  extractUntrusted,
  type UntrustedLimits
} from "../src/lib/hostExtract.js"
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
      const cp = { ...DEFAULT_LIMITS, linksWithin: [] }
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
      expect(message).toContain("huge.bin")
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

describe("what the work-out needs of the extractor", () => {
  it.effect("the archive of nothing (its end alone: GNU's record, or two zero blocks) is a valid, empty archive", () =>
    Effect.gen(function* () {
      for (const archive of [new Uint8Array(1024), new Uint8Array(10240)]) {
        const box = sandbox()
        const result = yield* extractUntrusted(Stream.make(archive), box.target)
        expect(result).toMatchObject({ files: 0, bytes: 0 })
        expect(fs.readdirSync(box.target)).toEqual([])
      }
      // less than that is no archive
      expect(yield* refused(new Uint8Array(512))).toContain("TAR_BAD_ARCHIVE")
      expect(yield* refused(new Uint8Array(0))).toContain("TAR_BAD_ARCHIVE")
    })
  )

  it.effect("cp: a link must stay inside what was copied, not only inside the repository", () =>
    Effect.gen(function* () {
      const within = (...parts: Array<string>) => ({ ...DEFAULT_LIMITS, linksWithin: parts })
      const dirs = [
        { path: "a/", type: "5" },
        { path: "a/b/", type: "5" },
        { path: "a/b/c/", type: "5" }
      ] as const
      // above the copied a/b (inside the repository): refused
      for (const linkpath of ["../../x", "../x", "c/../../x", "c/../..", "/abs"]) {
        const message = yield* refused(tar([...dirs, { path: "a/b/up", type: "2", linkpath }]), within("a", "b"))
        expect(message).toContain("points outside what was copied")
      }
      // a link that is the copied path itself points beside it
      expect(yield* refused(tar([...dirs, { path: "a/b/c/l", type: "2", linkpath: "f" }]), within("a", "b", "c", "l"))).toContain(
        "points outside"
      )
      // a `..` after a name could climb out through a link (l -> ..; x -> c/l/../..): refused
      expect(
        yield* refused(
          tar([...dirs, { path: "a/b/c/l", type: "2", linkpath: ".." }, { path: "a/b/x", type: "2", linkpath: "c/l/.." }]),
          within("a", "b")
        )
      ).toContain("a/b/x")
      // inside: down, and back up no higher than the copied root
      const box = sandbox()
      yield* extractUntrusted(
        Stream.make(
          tar([
            ...dirs,
            { path: "a/b/c/f", data: "f" },
            { path: "a/b/in", type: "2", linkpath: "c/f" },
            { path: "a/b/c/back", type: "2", linkpath: "../c/f" },
            { path: "a/b/c/./dot", type: "2", linkpath: "./f" }
          ])
        ),
        box.target,
        within("a", "b")
      )
      expect(fs.readFileSync(path.join(box.target, "a", "b", "c", "back"), "utf8")).toBe("f")
    })
  )

  it.effect("cp: `.git` entries at any depth (a directory, a file, any case, HFS+-ignored code points) are left out", () =>
    Effect.gen(function* () {
      const box = sandbox()
      const result = yield* extractUntrusted(
        Stream.make(
          tar([
            { path: ".git/", type: "5" },
            { path: ".git/config", data: "[core]\n\tfsmonitor = touch /tmp/pwned\n" },
            { path: "sub/.GIT/hooks/post-checkout", data: "#!/bin/sh\n" },
            { path: "sub/.g\u200cit/config", data: "x" },
            { path: "other/.git", data: "gitdir: /tmp\n" },
            { path: "link/.git", type: "2", linkpath: "../.git" },
            { path: "sub/work.txt", data: "work" },
            { path: ".gitignore", data: "x\n" }
          ])
        ),
        box.target,
        { ...DEFAULT_LIMITS, skipGit: true }
      )
      expect(result.skipped).toBe(6)
      const found: Array<string> = []
      const visit = (dir: string, rel: string) => {
        for (const name of fs.readdirSync(dir)) {
          const full = path.join(dir, name)
          found.push(rel + name)
          if (fs.lstatSync(full).isDirectory()) visit(full, `${rel}${name}/`)
        }
      }
      visit(box.target, "")
      expect(found.sort()).toEqual([".gitignore", "sub", "sub/work.txt"])
    })
  )

  it.effect("one file over its own limit is refused by its declared size, by name", () =>
    Effect.gen(function* () {
      const message = yield* refused(tar([{ path: "ok.txt", data: "x" }, { path: "big.bin", data: "y".repeat(2000) }]), {
        ...DEFAULT_LIMITS,
        maxFileBytes: 1024
      })
      expect(message).toContain('"big.bin" is too big: 2000 bytes')
    })
  )

  it.live("a refusal stops reading the guest's stream (its finalizer runs), instead of draining it to its end", () =>
    Effect.gen(function* () {
      let pulled = 0
      let stopped = false
      // a header that declares 4 GiB, then zeros for ever
      const header = tarHeader({ path: "huge.bin" }, 4 * 1024 * 1024 * 1024)
      const zeros = new Uint8Array(64 * 1024)
      const endless = Stream.concat(
        Stream.make(new Uint8Array(header)),
        Stream.repeatEffect(Effect.sync(() => (pulled++, zeros)))
      ).pipe(Stream.ensuring(Effect.sync(() => (stopped = true))))
      const box = sandbox()
      const error = yield* Effect.flip(extractUntrusted(endless, box.target, { ...DEFAULT_LIMITS, maxBytes: 1024 }))
      expect(error._tag).toBe("ArchiveRefused")
      expect(stopped).toBe(true)
      expect(pulled).toBeLessThan(1000)
    })
  )

  it.live("interrupted (the client gone): the stream is stopped and nothing more is written", () =>
    Effect.gen(function* () {
      let stopped = false
      const header = tarHeader({ path: "slow.bin" }, 1024 * 1024 * 1024)
      const trickle = Stream.concat(
        Stream.make(new Uint8Array(header)),
        Stream.repeatEffect(Effect.as(Effect.sleep("5 millis"), new Uint8Array(512)))
      ).pipe(Stream.ensuring(Effect.sync(() => (stopped = true))))
      const box = sandbox()
      const fiber = yield* Effect.fork(extractUntrusted(trickle, box.target))
      yield* Effect.sleep("200 millis")
      yield* Fiber.interrupt(fiber)
      expect(stopped).toBe(true)
      const size = fs.statSync(path.join(box.target, "slow.bin")).size
      yield* Effect.sleep("100 millis")
      expect(fs.statSync(path.join(box.target, "slow.bin")).size).toBe(size)
    })
  )

  it.effect("a guest that sends nothing for the idle bound is refused", () =>
    Effect.gen(function* () {
      const box = sandbox()
      const fiber = yield* Effect.fork(
        Effect.flip(extractUntrusted(Stream.concat(Stream.make(tar([{ path: "a", data: "x" }]).subarray(0, 512)), Stream.never), box.target))
      )
      yield* TestClock.adjust(EXPORT_IDLE_TIMEOUT)
      const error = yield* Fiber.join(fiber)
      expect(error._tag).toBe("ArchiveRefused")
      expect(error.message).toContain("sent nothing for 5m")
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
