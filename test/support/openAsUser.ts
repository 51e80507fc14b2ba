/**
 * `open` against FakeVmm in a process of its own (run as an unprivileged user by
 * test/repoDisk.test.ts: root reads every file, so an unreadable source needs another user).
 * argv: <home> <source>; prints one JSON line: the failure's tag and path, and what the home holds.
 */
import * as Effect from "effect/Effect"
import * as fs from "node:fs"
import * as path from "node:path"
import { open } from "../../src/programs/session.js"
import { fakeLifecycle } from "./fakeLifecycle.js"

const [home, source] = process.argv.slice(2) as [string, string]
const layer = fakeLifecycle(home)
const exit = await Effect.runPromiseExit(
  Effect.scoped(open({ source })).pipe(Effect.asVoid, Effect.provide(layer))
)
const error =
  exit._tag === "Failure"
    ? (exit.cause as { error?: { _tag?: string; path?: string; message?: string } }).error
    : undefined
const sessions = path.join(home, "sessions")
process.stdout.write(
  JSON.stringify({
    tag: error?._tag ?? exit._tag,
    path: error?.path,
    message: error?.message,
    sessions: fs.existsSync(sessions) ? fs.readdirSync(sessions).filter((d) => !d.startsWith(".")) : []
  }) + "\n"
)
