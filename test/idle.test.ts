import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Ref from "effect/Ref"
import * as TestClock from "effect/TestClock"
import { idleTimeout } from "../src/programs/idle.js"

describe("idle timeout (Clock-driven)", () => {
  it.scoped(
    "fires after the timeout without activity; a touch restarts it; a running turn holds it off",
    () =>
      Effect.gen(function* () {
        const fired = yield* Ref.make(0)
        const tracker = yield* idleTimeout(
          "10 seconds",
          Ref.update(fired, (n) => n + 1)
        )
        yield* TestClock.adjust("9 seconds")
        expect(yield* Ref.get(fired)).toBe(0)
        yield* tracker.touch
        yield* TestClock.adjust("9 seconds")
        expect(yield* Ref.get(fired)).toBe(0)
        yield* TestClock.adjust("1 second")
        expect(yield* Ref.get(fired)).toBe(1)

        yield* tracker.begin
        yield* TestClock.adjust("1 hour")
        expect(yield* Ref.get(fired)).toBe(1)
        yield* tracker.end
        yield* TestClock.adjust("10 seconds")
        expect(yield* Ref.get(fired)).toBe(2)
      })
  )
})
