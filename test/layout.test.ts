import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Layer from "effect/Layer"
import * as Scope from "effect/Scope"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import {
  CACHE_FILES,
  DEFAULT_IMAGE_FILE,
  HOME_FILES,
  IMAGE_FILES,
  IMAGE_META_FILE,
  KERNEL_IMAGE_FILE,
  SESSION_FILES
} from "../src/domain/sessionLayout.js"
import { RuntimeLockLive } from "../src/layers/RuntimeLockLive.js"
import { SessionStoreLive } from "../src/layers/SessionStoreLive.js"
import { listSessions, sessionStatus } from "../src/programs/list.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { RuntimeLock } from "../src/services/RuntimeLock.js"
import { SessionStore } from "../src/services/SessionStore.js"

/** an ABOX_HOME with one session in the current home and one in the legacy home (named "old") */
const homes = Effect.acquireRelease(
  Effect.sync(() => {
    const root = fs.mkdtempSync(path.join(os.tmpdir(), "abox-layout-"))
    const home = path.join(root, "abox")
    const userHome = path.join(root, "user")
    const legacySessions = path.join(userHome, "Library", "Application Support", "ABox", "sessions")
    const write = (dir: string, id: string) => {
      fs.mkdirSync(path.join(dir, id), { recursive: true, mode: 0o700 })
      const meta = { format: 1, id, created: "2024-01-01T00:00:00.000Z", source: "/x", model: "m" }
      fs.writeFileSync(path.join(dir, id, "session.json"), JSON.stringify(meta))
    }
    write(path.join(home, "sessions"), "current-session")
    write(legacySessions, "legacy-session")
    return { root, home, userHome, legacySessions }
  }),
  ({ root }) => Effect.sync(() => fs.rmSync(root, { recursive: true, force: true }))
)

const servicesAt = (home: string, userHome: string) =>
  Layer.mergeAll(SessionStoreLive, RuntimeLockLive).pipe(
    Layer.provideMerge(aboxPathsAt(home, userHome)),
    Layer.provide(NodeFileSystem.layer)
  )

describe("a session of the legacy home", () => {
  it.scoped("is located there, locks in its own directory, and shows running while held", () =>
    Effect.gen(function* () {
      const { home, userHome, legacySessions } = yield* homes
      const legacyDir = path.join(legacySessions, "legacy-session")
      yield* Effect.gen(function* () {
        const store = yield* SessionStore
        const lock = yield* RuntimeLock
        yield* store.bindName("old", "legacy-session")

        // by id and by name: the located directory, nothing else needed first
        const byId = yield* store.locate("legacy-session")
        expect(byId).toEqual({ id: "legacy-session", dir: legacyDir, legacy: true })
        expect(yield* store.locate("old")).toEqual(byId)
        expect(yield* store.locate("current-session")).toEqual({
          id: "current-session",
          dir: path.join(home, "sessions", "current-session"),
          legacy: false
        })

        const held = yield* Scope.make()
        const lease = yield* lock.acquire(byId).pipe(Scope.extend(held))
        expect(lease.path).toBe(path.join(legacyDir, "lock"))
        expect(fs.existsSync(path.join(home, "sessions", "legacy-session"))).toBe(false)
        const second = yield* Effect.flip(Effect.scoped(lock.acquire(byId)))
        expect(second._tag).toBe("SessionBusy")

        expect(yield* sessionStatus(byId)).toBe("running")
        const rows = yield* listSessions()
        expect(rows.map((r) => [r.id, r.legacy, r.status])).toEqual([
          ["current-session", false, "stopped"],
          ["legacy-session", true, "running"]
        ])

        yield* Scope.close(held, Exit.void)
        expect(yield* sessionStatus(byId)).toBe("stopped")
        yield* Effect.scoped(lock.acquire(byId))
      }).pipe(Effect.provide(servicesAt(home, userHome)))
    })
  )

  it.scoped("SessionStore.dir answers for it without an earlier lookup", () =>
    Effect.gen(function* () {
      const { home, userHome, legacySessions } = yield* homes
      // a fresh store: no list, get or resolve has run
      const store = yield* SessionStore.pipe(Effect.provide(servicesAt(home, userHome)))
      expect(store.dir("legacy-session")).toBe(path.join(legacySessions, "legacy-session"))
      expect(store.dir("current-session")).toBe(path.join(home, "sessions", "current-session"))
      // a session in neither home: where it would be made
      expect(store.dir("nowhere")).toBe(path.join(home, "sessions", "nowhere"))
    })
  )
})

describe("the layout", () => {
  it("names each file once, and docs/on-disk.md documents every name", () => {
    const names = [
      ...Object.values(HOME_FILES),
      ...Object.values(CACHE_FILES),
      ...Object.values(SESSION_FILES),
      ...Object.values(IMAGE_FILES),
      KERNEL_IMAGE_FILE,
      IMAGE_META_FILE,
      DEFAULT_IMAGE_FILE
    ]
    const sessionNames = Object.values(SESSION_FILES)
    expect(new Set(sessionNames).size).toBe(sessionNames.length)
    const doc = fs.readFileSync(path.join(import.meta.dirname, "..", "docs", "on-disk.md"), "utf8")
    expect(names.filter((name) => !doc.includes(name))).toEqual([])
  })
})
