import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as TestClock from "effect/TestClock"
import * as fs from "node:fs"
import * as path from "node:path"
import { ID_PATTERN, idTime, makeIdGenerator } from "../src/lib/ids.js"
import { writeFileAtomic } from "../src/lib/atomicFile.js"
import { encodeConfigDisk } from "../src/protocol/ConfigDisk.js"
import type { SessionMeta } from "../src/services/SessionStore.js"
import { tempStore } from "./storeHelpers.js"

const isRoot = process.getuid?.() === 0
const mode = (p: string) => fs.statSync(p).mode & 0o777
const input = { source: "/src/repo", model: "default" }

/** a failed read must leave the file exactly as it was */
const expectReadFails = (
  setup: (file: string) => void,
  tag: string,
  check?: (error: Record<string, unknown>) => void
) =>
  Effect.gen(function* () {
    const { store } = yield* tempStore
    const meta = yield* store.create(input)
    const file = path.join(store.dir(meta.id), "session.json")
    setup(file)
    const before = fs.readFileSync(file)
    const result = yield* Effect.either(store.get(meta.id))
    expect(Either.isLeft(result)).toBe(true)
    if (Either.isLeft(result)) {
      expect(result.left._tag).toBe(tag)
      check?.(result.left as unknown as Record<string, unknown>)
    }
    expect(fs.readFileSync(file).equals(before)).toBe(true)
    // the listing shows it as corrupt, with the same reason, and does not touch it either
    const rows = yield* store.list()
    expect(rows).toHaveLength(1)
    expect(rows[0]!._tag).toBe("Corrupt")
    if (rows[0]!._tag === "Corrupt") expect(rows[0]!.error._tag).toBe(tag)
    expect(fs.readFileSync(file).equals(before)).toBe(true)
  })

describe("ids", () => {
  it("are 26 lowercase base32 characters and sort by creation, even within one millisecond", () => {
    const gen = makeIdGenerator()
    const ids: Array<string> = []
    for (let t = 0; t < 50; t++) for (let k = 0; k < 20; k++) ids.push(gen.next(1_700_000_000_000 + t))
    for (const id of ids) expect(id).toMatch(ID_PATTERN)
    expect([...ids].sort()).toEqual(ids)
    expect(new Set(ids).size).toBe(ids.length)
    expect(idTime(ids[0]!)).toBe(1_700_000_000_000)
  })

  it("carry on past a full random part by borrowing the next millisecond", () => {
    const gen = makeIdGenerator((n) => new Uint8Array(n).fill(31))
    const a = gen.next(5)
    const b = gen.next(5)
    expect(b > a).toBe(true)
    expect(idTime(b)).toBe(6)
  })
})

describe("SessionStore", () => {
  it.scoped("create writes session.json (0600) in a 0700 dir and get reads it back", () =>
    Effect.gen(function* () {
      const { store, home } = yield* tempStore
      const meta = yield* store.create({
        ...input,
        guest: { arch: "x86_64", protocol: 4 },
        vmm: { backend: "qemu" }
      })
      expect(meta.id).toMatch(ID_PATTERN)
      const dir = store.dir(meta.id)
      expect(dir).toBe(path.join(home, "sessions", meta.id))
      expect(mode(dir)).toBe(0o700)
      expect(mode(path.join(dir, "session.json"))).toBe(0o600)
      expect(mode(path.join(home, "sessions"))).toBe(0o700)
      expect(yield* store.get(meta.id)).toEqual(meta)
      // no temp files or staging dirs left behind
      expect(fs.readdirSync(path.join(home, "sessions"))).toEqual([meta.id])
      expect(fs.readdirSync(dir)).toEqual(["session.json"])
    })
  )

  it.scoped("ids of created sessions sort by creation time", () =>
    Effect.gen(function* () {
      const { store } = yield* tempStore
      const made: Array<string> = []
      for (let i = 0; i < 5; i++) {
        made.push((yield* store.create(input)).id)
        yield* TestClock.adjust(i % 2 === 0 ? "1 millis" : "0 millis")
      }
      expect([...made].sort()).toEqual(made)
      const listed = (yield* store.list()).map((r) => r.id)
      expect(listed).toEqual(made)
    })
  )

  it.scoped("a missing session is SessionNotFound", () =>
    Effect.gen(function* () {
      const { store } = yield* tempStore
      for (const ref of ["01hzzzzzzzzzzzzzzzzzzzzzzz", "../etc", ".", "a/b", ""]) {
        const error = yield* Effect.flip(store.get(ref))
        expect(error._tag).toBe("SessionNotFound")
      }
    })
  )

  it.scoped("a missing session.json is SessionNotFound on get, corrupt in the listing", () =>
    Effect.gen(function* () {
      const { store } = yield* tempStore
      const meta = yield* store.create(input)
      fs.rmSync(path.join(store.dir(meta.id), "session.json"))
      expect((yield* Effect.flip(store.get(meta.id)))._tag).toBe("SessionNotFound")
      const rows = yield* store.list()
      expect(rows[0]!._tag).toBe("Corrupt")
      if (rows[0]!._tag === "Corrupt") expect(rows[0]!.error.message).toContain("missing")
      expect(fs.existsSync(store.dir(meta.id))).toBe(true)
    })
  )

  it.scoped("truncated JSON is SessionCorrupt naming the path", () =>
    expectReadFails(
      (file) => fs.writeFileSync(file, fs.readFileSync(file).subarray(0, 20)),
      "SessionCorrupt",
      (e) => {
        expect(String(e.path)).toMatch(/session\.json$/)
        expect(String(e.reason)).toContain("not valid JSON")
      }
    )
  )

  it.scoped("an empty file is SessionCorrupt", () =>
    expectReadFails(
      (file) => fs.writeFileSync(file, ""),
      "SessionCorrupt",
      (e) => expect(e.reason).toBe("the file is empty")
    )
  )

  it.scoped("garbage bytes are SessionCorrupt", () =>
    expectReadFails((file) => fs.writeFileSync(file, Buffer.from([0xff, 0x00, 0x7b, 0x22])), "SessionCorrupt")
  )

  it.scoped("a schema mismatch is SessionCorrupt with the reason", () =>
    expectReadFails(
      (file) => {
        const json = JSON.parse(fs.readFileSync(file, "utf8")) as Record<string, unknown>
        fs.writeFileSync(file, JSON.stringify({ ...json, model: 42 }))
      },
      "SessionCorrupt",
      (e) => expect(String(e.reason)).toContain("model")
    )
  )

  it.scoped("an id that does not match its directory is SessionCorrupt", () =>
    expectReadFails((file) => {
      const json = JSON.parse(fs.readFileSync(file, "utf8")) as Record<string, unknown>
      fs.writeFileSync(file, JSON.stringify({ ...json, id: "someoneelse" }))
    }, "SessionCorrupt")
  )

  it.scoped("a newer format is SessionFormatTooNew", () =>
    expectReadFails(
      (file) => {
        const json = JSON.parse(fs.readFileSync(file, "utf8")) as Record<string, unknown>
        fs.writeFileSync(file, JSON.stringify({ ...json, format: 7, newField: true }))
      },
      "SessionFormatTooNew",
      (e) => {
        expect(e.found).toBe(7)
        expect(e.supported).toBe(1)
      }
    )
  )

  it.scoped.skipIf(isRoot)("an unreadable session dir is StoreIoError (not root: root reads anything)", () =>
    Effect.gen(function* () {
      const { store } = yield* tempStore
      const meta = yield* store.create(input)
      fs.chmodSync(store.dir(meta.id), 0o000)
      try {
        expect((yield* Effect.flip(store.get(meta.id)))._tag).toBe("StoreIoError")
      } finally {
        fs.chmodSync(store.dir(meta.id), 0o700)
      }
    })
  )

  it.scoped("an unreadable session.json (a directory in its place) is StoreIoError", () =>
    Effect.gen(function* () {
      const { store } = yield* tempStore
      const meta = yield* store.create(input)
      const file = path.join(store.dir(meta.id), "session.json")
      fs.rmSync(file)
      fs.mkdirSync(file)
      expect((yield* Effect.flip(store.get(meta.id)))._tag).toBe("StoreIoError")
      expect(fs.statSync(file).isDirectory()).toBe(true)
    })
  )

  it.scoped("update is read-modify-atomic-write and keeps id and format", () =>
    Effect.gen(function* () {
      const { store } = yield* tempStore
      const meta = yield* store.create(input)
      const next = yield* store.update(meta.id, (m): SessionMeta => ({ ...m, model: "other", id: "evil" }))
      expect(next.model).toBe("other")
      expect(next.id).toBe(meta.id)
      expect((yield* store.get(meta.id)).model).toBe("other")
      expect(mode(path.join(store.dir(meta.id), "session.json"))).toBe(0o600)
      expect(fs.readdirSync(store.dir(meta.id))).toEqual(["session.json"])
    })
  )

  it.scoped("guest-config.json round-trips, and a bad one is a typed error left intact", () =>
    Effect.gen(function* () {
      const { store } = yield* tempStore
      const meta = yield* store.create(input)
      const config = { format: 1 as const, sessionId: meta.id, model: "default" }
      yield* store.writeGuestConfig(meta.id, config)
      const file = path.join(store.dir(meta.id), "guest-config.json")
      expect(mode(file)).toBe(0o600)
      expect(yield* store.readGuestConfig(meta.id)).toEqual(config)
      fs.writeFileSync(file, '{"format":2}')
      expect((yield* Effect.flip(store.readGuestConfig(meta.id)))._tag).toBe("SessionFormatTooNew")
      fs.writeFileSync(file, '{"format":1}')
      expect((yield* Effect.flip(store.readGuestConfig(meta.id)))._tag).toBe("SessionCorrupt")
      expect(fs.readFileSync(file, "utf8")).toBe('{"format":1}')
    })
  )

  it.scoped("remove deletes the session dir and its names, and only that", () =>
    Effect.gen(function* () {
      const { store, home } = yield* tempStore
      const a = yield* store.create({ ...input, name: "alpha" })
      const b = yield* store.create(input)
      yield* store.bindName("beta", b.id)
      yield* store.bindName("alpha-2", a.id)
      yield* store.remove(a.id)
      expect(fs.existsSync(store.dir(a.id))).toBe(false)
      expect(fs.readdirSync(path.join(home, "sessions"))).toEqual([b.id])
      expect((yield* store.listNames()).map((n) => n.name)).toEqual(["beta"])
      expect((yield* Effect.flip(store.remove(a.id)))._tag).toBe("SessionNotFound")
    })
  )

  it.scoped("writeFileAtomic replaces a file whole, with the mode asked for, and leaves no temp file", () =>
    Effect.gen(function* () {
      const { root } = yield* tempStore
      const file = path.join(root, "config.raw")
      const disk = encodeConfigDisk({ format: 1, sessionId: "x", model: "m" })
      yield* writeFileAtomic(file, Buffer.from("old"), 0o644)
      yield* writeFileAtomic(file, disk, 0o600)
      expect(fs.readFileSync(file).equals(disk)).toBe(true)
      expect(mode(file)).toBe(0o600)
      expect(fs.readdirSync(root).filter((f) => f.startsWith("."))).toEqual([])
    })
  )
})

describe("legacy home", () => {
  const writeLegacy = (dir: string, id: string, body: string) => {
    fs.mkdirSync(path.join(dir, id), { recursive: true })
    fs.writeFileSync(path.join(dir, id, "session.json"), body)
  }

  it.scoped("legacy sessions are listed (legacy: true), readable, never modified or removed", () =>
    Effect.gen(function* () {
      const { store, legacySessions } = yield* tempStore
      const current = yield* store.create(input)
      const legacyMeta = {
        format: 1,
        id: "old-session",
        created: "2024-01-01T00:00:00.000Z",
        source: "/x",
        model: "m"
      }
      writeLegacy(legacySessions, "old-session", JSON.stringify(legacyMeta))
      writeLegacy(legacySessions, "broken", "{")
      const rows = yield* store.list()
      expect(rows.map((r) => [r.id, r.legacy, r._tag])).toEqual([
        [current.id, false, "Ok"],
        ["broken", true, "Corrupt"],
        ["old-session", true, "Ok"]
      ])
      expect(yield* store.get("old-session")).toEqual(legacyMeta)
      expect(store.dir("old-session")).toBe(path.join(legacySessions, "old-session"))
      expect(yield* store.resolve("old-session")).toBe("old-session")
      const before = fs.readFileSync(path.join(legacySessions, "old-session", "session.json"))
      expect((yield* Effect.flip(store.remove("old-session")))._tag).toBe("StoreIoError")
      expect((yield* Effect.flip(store.update("old-session", (m) => ({ ...m, model: "x" }))))._tag).toBe(
        "StoreIoError"
      )
      expect(fs.readFileSync(path.join(legacySessions, "old-session", "session.json")).equals(before)).toBe(
        true
      )
    })
  )

  it.scoped("an absent legacy home lists nothing", () =>
    Effect.gen(function* () {
      const { store } = yield* tempStore
      expect(yield* store.list()).toEqual([])
    })
  )
})
