import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as fc from "fast-check"
import * as fs from "node:fs"
import * as path from "node:path"
import { NAME_FILE_PATTERN, nameProblem, sanitiseName } from "../src/lib/names.js"
import { tempStore } from "./storeHelpers.js"

const input = { source: "/src/repo", model: "default" }
const validName = fc
  .string({ unit: "binary", minLength: 1, maxLength: 40 })
  .filter((s) => nameProblem(s) === null)

describe("sanitiseName", () => {
  it("maps every name to [A-Za-z0-9_-]+, one character per code point, idempotently", () => {
    fc.assert(
      fc.property(validName, (name) => {
        const stem = sanitiseName(name)
        expect(stem).toMatch(NAME_FILE_PATTERN)
        expect(stem.length).toBe([...name].length)
        expect(sanitiseName(stem)).toBe(stem)
      })
    )
  })

  it("keeps names that are already safe", () => {
    fc.assert(
      fc.property(fc.stringMatching(/^[A-Za-z0-9_-]{1,40}$/), (name) => {
        expect(sanitiseName(name)).toBe(name)
      })
    )
  })

  it("rejects empty, dot, over-long and control-character names", () => {
    expect(nameProblem("")).toBe("empty")
    expect(nameProblem(".")).toBe("dot")
    expect(nameProblem("..")).toBe("dot")
    expect(nameProblem("x".repeat(129))).toBe("too-long")
    expect(nameProblem("a\nb")).toBe("control-character")
    expect(nameProblem("my project/1")).toBeNull()
  })
})

describe("names in the store", () => {
  it.scoped("bind, lookup, resolve, list, unbind; files 0600 beside a lock file", () =>
    Effect.gen(function* () {
      const { store, home } = yield* tempStore
      const meta = yield* store.create(input)
      const binding = yield* store.bindName("my project", meta.id)
      expect(binding).toMatchObject({ name: "my project", sessionId: meta.id })
      const file = path.join(home, "names", "my_project.json")
      expect(fs.statSync(file).mode & 0o777).toBe(0o600)
      expect(fs.existsSync(`${file}.lock`)).toBe(true)
      expect(JSON.parse(fs.readFileSync(file, "utf8"))).toMatchObject({ format: 1, name: "my project" })
      expect(yield* store.lookupName("my project")).toEqual(binding)
      expect(yield* store.resolve("my project")).toBe(meta.id)
      expect(yield* store.listNames()).toEqual([binding])
      // binding the same name to the same session again is a no-op
      expect(yield* store.bindName("my project", meta.id)).toEqual(binding)
      yield* store.unbindName("my project")
      expect((yield* Effect.flip(store.lookupName("my project")))._tag).toBe("SessionNotFound")
      expect(fs.readdirSync(path.join(home, "names")).filter((f) => !f.endsWith(".lock"))).toEqual([])
    })
  )

  it.scoped("a session id is never a name (ids resolve first: such a name would point rm elsewhere)", () =>
    Effect.gen(function* () {
      const { store } = yield* tempStore
      const a = yield* store.create(input)
      const b = yield* store.create(input)
      const error = yield* Effect.flip(store.bindName(a.id, b.id))
      expect(error._tag).toBe("InvalidName")
      expect(yield* store.resolve(a.id)).toBe(a.id)
    })
  )

  it.scoped("a name whose session is gone is a dangling SessionNotFound; it can then be rebound", () =>
    Effect.gen(function* () {
      const { store } = yield* tempStore
      const a = yield* store.create(input)
      yield* store.bindName("dev", a.id)
      fs.rmSync(store.dir(a.id), { recursive: true })
      const error = yield* Effect.flip(store.resolve("dev"))
      expect(error._tag).toBe("SessionNotFound")
      expect(error.message).toContain("dangling")
      const b = yield* store.create(input)
      expect((yield* store.bindName("dev", b.id)).sessionId).toBe(b.id)
    })
  )

  it.scoped("invalid names are InvalidName; a name for a missing session is SessionNotFound", () =>
    Effect.gen(function* () {
      const { store } = yield* tempStore
      const a = yield* store.create(input)
      for (const bad of ["", ".", "..", "x".repeat(200)]) {
        expect((yield* Effect.flip(store.bindName(bad, a.id)))._tag).toBe("InvalidName")
      }
      expect((yield* Effect.flip(store.bindName("ok", "nope")))._tag).toBe("SessionNotFound")
    })
  )

  it.scoped("create with a taken name fails and leaves neither a session nor a name behind", () =>
    Effect.gen(function* () {
      const { store, home } = yield* tempStore
      const a = yield* store.create({ ...input, name: "web" })
      const error = yield* Effect.flip(store.create({ ...input, name: "web" }))
      expect(error._tag).toBe("NameTaken")
      expect(fs.readdirSync(path.join(home, "sessions"))).toEqual([a.id])
      expect((yield* store.lookupName("web")).sessionId).toBe(a.id)
      expect((yield* Effect.flip(store.create({ ...input, name: "" })))._tag).toBe("InvalidName")
      expect(fs.readdirSync(path.join(home, "sessions"))).toEqual([a.id])
    })
  )

  it.scoped("distinct names that sanitise to one file are refused, never overwritten (property)", () =>
    Effect.gen(function* () {
      const { store, home } = yield* tempStore
      const a = yield* store.create(input)
      const b = yield* store.create(input)
      const pairs = fc.sample(
        validName.chain((x) =>
          fc
            .array(fc.constantFrom("_", " ", "/", "é", ".", "😀"), {
              minLength: [...x].length,
              maxLength: [...x].length
            })
            .map((subs) => {
              // the same shape with other unsafe characters in the unsafe places
              const chars = [...x]
              const twin = chars.map((c, i) => (/^[A-Za-z0-9-]$/.test(c) ? c : subs[i]!)).join("")
              return [x, twin] as const
            })
        ),
        40
      )
      let collisions = 0
      for (const [x, y] of pairs) {
        if (sanitiseName(x) !== sanitiseName(y)) continue
        const first = yield* Effect.either(store.bindName(x, a.id))
        if (first._tag === "Left") continue // the stem was taken by an earlier pair
        const file = path.join(home, "names", `${sanitiseName(x)}.json`)
        const before = fs.readFileSync(file)
        if (x === y) {
          expect((yield* store.bindName(y, a.id)).name).toBe(x)
          expect((yield* Effect.flip(store.bindName(y, b.id)))._tag).toBe("NameTaken")
        } else {
          const error = yield* Effect.flip(store.bindName(y, b.id))
          expect(error._tag).toBe(nameProblem(y) === null ? "NameTaken" : "InvalidName")
          collisions++
          expect((yield* Effect.flip(store.lookupName(y)))._tag).toBe("SessionNotFound")
        }
        expect(fs.readFileSync(file).equals(before)).toBe(true)
        expect((yield* store.lookupName(x)).sessionId).toBe(a.id)
      }
      // the generator does produce distinct colliding names
      expect(collisions).toBeGreaterThan(0)
    })
  )

  it.scoped("many fibers binding one name to different sessions: exactly one wins", () =>
    Effect.gen(function* () {
      const { store } = yield* tempStore
      const sessions = yield* Effect.forEach(Array.from({ length: 12 }), () => store.create(input))
      const results = yield* Effect.forEach(sessions, (s) => Effect.either(store.bindName("shared", s.id)), {
        concurrency: "unbounded"
      })
      const winners = results.filter((r) => r._tag === "Right")
      expect(winners).toHaveLength(1)
      for (const r of results) if (r._tag === "Left") expect(r.left._tag).toBe("NameTaken")
      const bound = yield* store.lookupName("shared")
      expect(winners[0]!._tag === "Right" && winners[0]!.right.sessionId).toBe(bound.sessionId)
    })
  )
})
