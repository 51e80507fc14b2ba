/**
 * removeTemp (src/lib/atomicFile.ts), the cleanup of temp files and directories after a step
 * (disk clones, the diff's trees, cp's staging): it removes what it is given, and a removal that
 * fails is a logged warning with its cause, never a defect that replaces the step's own error.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Logger from "effect/Logger"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { removeTemp } from "../src/lib/atomicFile.js"

describe("removeTemp", () => {
  it.effect("removes a temp directory with its content; an absent one is nothing to do", () =>
    Effect.gen(function* () {
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-temp-"))
      fs.writeFileSync(path.join(dir, "f"), "x")
      yield* removeTemp(dir)
      expect(fs.existsSync(dir)).toBe(false)
      yield* removeTemp(dir)
    })
  )

  it.effect(
    "a removal that fails: a warning naming the path and keeping the cause, and the step's own error stays",
    () =>
      Effect.gen(function* () {
        const logged: Array<{ level: string; message: unknown; cause: string }> = []
        const capture = Logger.replace(
          Logger.defaultLogger,
          Logger.make(({ logLevel, message, cause }) =>
            logged.push({ level: logLevel.label, message, cause: String(cause) })
          )
        )
        // nothing can remove a /proc file, not even root
        const step = Effect.fail("the step's error" as const).pipe(
          Effect.ensuring(removeTemp("/proc/self/status"))
        )
        const exit = yield* Effect.exit(step.pipe(Effect.provide(capture)))
        expect(exit).toStrictEqual(Exit.fail("the step's error"))
        expect(logged).toHaveLength(1)
        expect(logged[0]!.level).toBe("WARN")
        expect(JSON.stringify(logged[0]!.message)).toContain("cannot remove /proc/self/status")
      })
  )
})
