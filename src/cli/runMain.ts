import { makeRunMain } from "@effect/platform/Runtime"
import * as Effect from "effect/Effect"
import { constants } from "node:os"

let sessionsHeld = 0

/** while `effect` runs, a signal says it closes a session (other commands just stop) */
export const holdingSession = <A, E, R>(effect: Effect.Effect<A, E, R>) =>
  Effect.acquireUseRelease(
    Effect.sync(() => sessionsHeld++),
    () => effect,
    () => Effect.sync(() => sessionsHeld--)
  )

/** The termination signals the CLI turns into Close (SIGINT, SIGTERM and SIGHUP). */
export const CLOSE_SIGNALS = ["SIGINT", "SIGTERM", "SIGHUP"] as const

/**
 * Like NodeRuntime.runMain, with SIGHUP too: the first termination signal interrupts the main
 * fiber, so every session scope runs its finalizers (the one Close path); the listeners are
 * removed at once, so a second signal gets the operating system's default forced exit (the
 * VMM helper still stops the VM when its liveness pipe closes).
 */
export const runMain = makeRunMain(({ fiber, teardown }) => {
  const keepAlive = setInterval(() => {}, 2 ** 31 - 1)
  let receivedSignal: NodeJS.Signals | undefined
  const removeListeners = () => {
    for (const signal of CLOSE_SIGNALS) process.removeListener(signal, onSignal)
  }
  function onSignal(signal: NodeJS.Signals) {
    receivedSignal = signal
    removeListeners()
    // say so: the close takes a moment (the guest powers off), and a second signal cuts it short
    process.stderr.write(
      sessionsHeld > 0
        ? `\nabox: ${signal}: closing (a second signal exits at once)\n`
        : `\nabox: ${signal}\n`
    )
    fiber.unsafeInterruptAsFork(fiber.id())
  }
  for (const signal of CLOSE_SIGNALS) process.on(signal, onSignal)
  // a reader that went away (`abox run --json … | head -1`): close the session as for a signal,
  // rather than die on an unhandled EPIPE; later writes fail into this same handler, quietly
  const onOutputError = (error: NodeJS.ErrnoException) => {
    if (error.code !== "EPIPE") throw error
    if (receivedSignal !== undefined) return
    receivedSignal = "SIGPIPE"
    removeListeners()
    fiber.unsafeInterruptAsFork(fiber.id())
  }
  process.stdout.on("error", onOutputError)
  process.stderr.on("error", onOutputError)
  fiber.addObserver((exit) => {
    if (receivedSignal === undefined) removeListeners()
    clearInterval(keepAlive)
    teardown(exit, (code) => {
      // after a signal, exit as the shell expects of a process that signal ended (128 + n)
      if (receivedSignal !== undefined) process.exit(128 + constants.signals[receivedSignal])
      if (code !== 0) process.exit(code)
    })
  })
})
