/**
 * The lifecycle programs (open, resume, turn, close) against FakeVmm: the real guest agent as a
 * host process over a real unix socket, the real store, lock and protocol layers.
 */
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Fiber from "effect/Fiber"
import * as Layer from "effect/Layer"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import * as FakeVmm from "../src/layers/FakeVmm.js"
import { fileChecksums } from "./cliHelpers.js"
import { open, resume, type Phase } from "../src/programs/session.js"
import { SessionStore } from "../src/services/SessionStore.js"
import { fakeLifecycle } from "./support/fakeLifecycle.js"

const tempDir = (prefix: string) => fs.mkdtempSync(path.join(os.tmpdir(), prefix))

const layerFor = (home: string, vmm = FakeVmm.layer) => fakeLifecycle(home, { vmm })

const sourceTree = () => {
  const source = tempDir("abox-src-")
  fs.writeFileSync(path.join(source, "README.md"), "# project\n")
  fs.mkdirSync(path.join(source, "bin"))
  fs.writeFileSync(path.join(source, "bin", "run.sh"), "#!/bin/sh\necho ran\n", { mode: 0o755 })
  // a link pointing out of the tree: copied as a link, never followed
  const outside = tempDir("abox-outside-")
  fs.writeFileSync(path.join(outside, "secret.txt"), "outside-canary-7c1f\n")
  fs.symlinkSync(path.join(outside, "secret.txt"), path.join(source, "escape"))
  return source
}

const collect = (stream: Stream.Stream<{ readonly _tag: string }, unknown>) =>
  Stream.runCollect(stream).pipe(Effect.map((chunk) => Array.from(chunk)))

const stdoutOf = (events: ReadonlyArray<unknown>) =>
  events
    .map((e) => {
      const ev = e as { _tag: string; event?: { kind: string; data?: string } }
      return ev._tag === "Event" && ev.event?.kind === "stdout" ? ev.event.data : ""
    })
    .join("")

const sessionDirs = (home: string) =>
  fs.existsSync(path.join(home, "sessions")) ? fs.readdirSync(path.join(home, "sessions")) : []

describe("open → turn → close → resume (FakeVmm)", () => {
  it.live("a whole life: exact snapshot, turns, graceful close recorded, resume sees the files", () => {
    const home = tempDir("abox-home-")
    const source = sourceTree()
    return Effect.gen(function* () {
      const store = yield* SessionStore
      const id = yield* Effect.scoped(
        Effect.gen(function* () {
          const session = yield* open({ source, name: "proj" })
          expect(session.hello.protocol).toBe(4)
          const listing = stdoutOf(
            yield* collect(session.turn("ls -la; readlink escape; cat escape 2>&1; ./bin/run.sh"))
          )
          expect(listing).toContain("README.md")
          expect(listing).toMatch(/-rwxr-xr-x .* run\.sh|ran/)
          expect(listing).toContain(path.join(path.dirname(fs.realpathSync(source)), "")) // the link's target path
          expect(listing).not.toContain("outside-canary-7c1f") // the link was not followed on the host
          expect(listing).toContain("ran")
          const failing = yield* collect(session.turn("echo written > made-in-guest.txt; exit 3"))
          expect(failing.at(-1)).toMatchObject({ _tag: "End", exitCode: 3 })
          return session.id
        })
      )
      const meta = yield* store.get(id)
      expect(meta.lastClose?.how).toBe("graceful")
      expect(meta.name).toBe("proj")
      expect((yield* store.lookupName("proj")).sessionId).toBe(id)
      const guestConfig = yield* store.readGuestConfig(id)
      expect(guestConfig).toMatchObject({ sessionId: id, model: "default" })

      yield* Effect.scoped(
        Effect.gen(function* () {
          const session = yield* resume("proj", { model: "other" })
          expect(session.id).toBe(id)
          expect(session.hello.contextTurns).toBe(2)
          expect(stdoutOf(yield* collect(session.turn("cat made-in-guest.txt")))).toBe("written\n")
        })
      )
      expect((yield* store.readGuestConfig(id)).model).toBe("other")
      expect((yield* store.get(id)).model).toBe("other")
    }).pipe(Effect.provide(layerFor(home)))
  })

  it.live("the environment's env reaches turns, and stays the session's on resume", () => {
    const home = tempDir("abox-home-")
    const source = sourceTree()
    return Effect.gen(function* () {
      const id = yield* Effect.scoped(
        Effect.gen(function* () {
          const session = yield* open({ source, env: { GREETING: "hello-env" } })
          expect(stdoutOf(yield* collect(session.turn("echo \"G=$GREETING\"")))).toBe("G=hello-env\n")
          return session.id
        })
      )
      yield* Effect.scoped(
        Effect.gen(function* () {
          const session = yield* resume(id)
          expect(stdoutOf(yield* collect(session.turn("echo \"G=$GREETING\"")))).toBe("G=hello-env\n")
        })
      )
    }).pipe(Effect.provide(layerFor(home)))
  })

  it.live(
    "a VM that dies before hello: open fails at once and leaves nothing (no dir, no name, lock free)",
    () => {
      const home = tempDir("abox-home-")
      const source = sourceTree()
      const dying = FakeVmm.layerWith({ command: () => ["/bin/sh", "-c", "echo boom; exit 9"] }).pipe(
        Layer.provide(NodeFileSystem.layer)
      )
      return Effect.gen(function* () {
        const store = yield* SessionStore
        const started = Date.now()
        const exit = yield* Effect.scoped(open({ source, name: "doomed" })).pipe(Effect.exit)
        expect(Exit.isFailure(exit)).toBe(true)
        if (Exit.isFailure(exit)) expect(JSON.stringify(exit.cause)).toContain("GuestDisconnected")
        // the console's tail is in the message: the session directory (and console.log) is gone
        if (Exit.isFailure(exit)) expect(JSON.stringify(exit.cause)).toContain("its console ended: boom")
        expect(Date.now() - started).toBeLessThan(15_000)
        expect(sessionDirs(home).filter((d) => !d.startsWith("."))).toEqual([])
        // the VM's logs outlive the session directory, in failed-open/ (0600)
        const kept = path.join(home, "failed-open", "console.log")
        expect(fs.readFileSync(kept, "utf8")).toContain("boom")
        expect(fs.statSync(kept).mode & 0o777).toBe(0o600)
        expect(
          yield* store.lookupName("doomed").pipe(
            Effect.flip,
            Effect.map((e) => e._tag)
          )
        ).toBe("SessionNotFound")
      }).pipe(Effect.provide(layerFor(home, dying)))
    }
  )

  it.live("interrupted mid-open: the guest process is stopped and nothing is left behind", () => {
    const home = tempDir("abox-home-")
    const source = sourceTree()
    return Effect.gen(function* () {
      const booting = yield* Deferred.make<void>()
      const onPhase = (phase: Phase) =>
        phase === "boot" ? Deferred.succeed(booting, undefined) : Effect.void
      const fiber = yield* Effect.fork(
        Effect.scoped(Effect.zipRight(open({ source, name: "half", onPhase }), Effect.never))
      )
      yield* Deferred.await(booting)
      yield* Fiber.interrupt(fiber)
      expect(sessionDirs(home).filter((d) => !d.startsWith("."))).toEqual([])
      // no guest agent of that home still running
      const procs = fs.readdirSync("/proc").filter((p) => /^\d+$/.test(p))
      const ours = procs.filter((p) => {
        try {
          return fs.readFileSync(`/proc/${p}/cmdline`, "utf8").includes(home)
        } catch {
          return false
        }
      })
      expect(ours).toEqual([])
    }).pipe(Effect.provide(layerFor(home)))
  })

  it.live("a name already bound: NameTaken before anything is made", () => {
    const home = tempDir("abox-home-")
    const source = sourceTree()
    return Effect.gen(function* () {
      yield* Effect.scoped(open({ source, name: "taken" }))
      const before = sessionDirs(home).length
      const error = yield* Effect.scoped(open({ source, name: "taken" })).pipe(Effect.flip)
      expect(error._tag).toBe("NameTaken")
      expect(sessionDirs(home).length).toBe(before)
    }).pipe(Effect.provide(layerFor(home)))
  })

  it.live("a source that is not a directory: SourceInvalid, nothing made", () => {
    const home = tempDir("abox-home-")
    return Effect.gen(function* () {
      const error = yield* Effect.scoped(open({ source: path.join(home, "nope") })).pipe(Effect.flip)
      expect(error._tag).toBe("SourceInvalid")
      expect(sessionDirs(home)).toEqual([])
    }).pipe(Effect.provide(layerFor(home)))
  })
})

describe("resume refuses before touching config or disk", () => {
  const withSession = <A, E>(
    edit: (meta: Record<string, unknown>) => Record<string, unknown> | string,
    check: (id: string, home: string) => Effect.Effect<A, E, Layer.Layer.Success<ReturnType<typeof layerFor>>>
  ) => {
    const home = tempDir("abox-home-")
    const source = sourceTree()
    return Effect.gen(function* () {
      const id = yield* Effect.scoped(Effect.map(open({ source }), (s) => s.id))
      const file = path.join(home, "sessions", id, "session.json")
      const edited = edit(JSON.parse(fs.readFileSync(file, "utf8")) as Record<string, unknown>)
      fs.writeFileSync(file, typeof edited === "string" ? edited : JSON.stringify(edited))
      const before = fileChecksums(path.join(home, "sessions", id))
      yield* check(id, home)
      expect(fileChecksums(path.join(home, "sessions", id))).toEqual(before)
    }).pipe(Effect.provide(layerFor(home)))
  }

  const refusal = (id: string) => Effect.scoped(resume(id)).pipe(Effect.flip)

  it.live("corrupt session.json → SessionCorrupt naming the file", () =>
    withSession(
      () => '{"format":1,"id":',
      (id) =>
        Effect.map(refusal(id), (e) => {
          expect(e._tag).toBe("SessionCorrupt")
          expect(e.message).toContain("session.json")
        })
    )
  )

  it.live("a session that predates the metadata (legacy format) → SessionIncompatible on Linux", () =>
    withSession(
      ({ guest: _g, vmm: _v, ...rest }) => rest,
      (id) =>
        Effect.map(refusal(id), (e) =>
          expect(e).toMatchObject({ _tag: "SessionIncompatible", field: "metadata" })
        )
    )
  )

  it.live("a foreign-arch session → SessionIncompatible guest.arch", () =>
    withSession(
      (meta) => ({ ...meta, guest: { arch: process.arch === "arm64" ? "x86_64" : "aarch64", protocol: 4 } }),
      (id) =>
        Effect.map(refusal(id), (e) =>
          expect(e).toMatchObject({ _tag: "SessionIncompatible", field: "guest.arch" })
        )
    )
  )

  it.live("another backend's session → SessionIncompatible vmm.backend", () =>
    withSession(
      (meta) => ({ ...meta, vmm: { backend: "vz" } }),
      (id) =>
        Effect.map(refusal(id), (e) =>
          expect(e).toMatchObject({ _tag: "SessionIncompatible", field: "vmm.backend" })
        )
    )
  )

  it.live("a pre-v4 guest → GuestTooOld with the fix", () =>
    withSession(
      (meta) => ({ ...meta, guest: { arch: process.arch === "arm64" ? "aarch64" : "x86_64", protocol: 3 } }),
      (id) =>
        Effect.map(refusal(id), (e) => {
          expect(e._tag).toBe("GuestTooOld")
          expect(e.message).toMatch(/image-update.*open/)
        })
    )
  )

  it.live("a session someone else runs → SessionBusy at once, no file of it touched", () => {
    const home = tempDir("abox-home-")
    const source = sourceTree()
    return Effect.gen(function* () {
      const id = yield* Effect.scoped(Effect.map(open({ source }), (s) => s.id))
      yield* Effect.scoped(
        Effect.gen(function* () {
          yield* resume(id)
          const dir = path.join(home, "sessions", id)
          const before = fileChecksums(dir)
          const started = Date.now()
          const second = yield* refusal(id)
          expect(second).toMatchObject({ _tag: "SessionBusy", sessionId: id })
          expect(Date.now() - started).toBeLessThan(2_000)
          expect(fileChecksums(dir)).toEqual(before)
        })
      )
    }).pipe(Effect.provide(layerFor(home)))
  })
})
