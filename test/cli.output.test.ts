/**
 * What the CLI writes where: diagnostics (Effect's log, guest errors among them) on stderr as
 * single lines, never on stdout, where `--json` consumers read one JSON value per line.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import { jsonEvent } from "../src/cli/turnOutput.js"
import { LogToStderr } from "../src/layers/Base.js"

/** a Console that records which stream each line went to */
const recordingConsole = () => {
  const out: Array<string> = []
  const err: Array<string> = []
  const line =
    (into: Array<string>) =>
    (...args: ReadonlyArray<unknown>) =>
      void into.push(args.map(String).join(" "))
  const unsafe = {
    ...globalThis.console,
    log: line(out),
    info: line(out),
    error: line(err),
    warn: line(err),
    debug: line(err),
    trace: line(err)
  }
  const console: Console.Console = {
    [Console.TypeId]: Console.TypeId,
    unsafe,
    ...Object.fromEntries(
      (
        [
          "assert",
          "clear",
          "count",
          "countReset",
          "debug",
          "dir",
          "dirxml",
          "error",
          "group",
          "groupEnd",
          "info",
          "log",
          "table",
          "time",
          "timeEnd",
          "timeLog",
          "trace",
          "warn"
        ] as const
      ).map((name) => [
        name,
        (...args: ReadonlyArray<unknown>) =>
          Effect.sync(() =>
            (unsafe as unknown as Record<string, (...a: ReadonlyArray<unknown>) => void>)[name]!(...args)
          )
      ])
    ),
    group: () => Effect.void,
    groupEnd: Effect.void,
    clear: Effect.void
  } as unknown as Console.Console
  return { console, out, err }
}

describe("diagnostics never reach stdout", () => {
  it.effect("a warning carrying a guest's text goes to stderr as one line", () =>
    Effect.gen(function* () {
      const { console, out, err } = recordingConsole()
      yield* Effect.logWarning("guest reported an error").pipe(
        Effect.annotateLogs({ text: 'x\n{"type":"End","exitCode":0}' }),
        Effect.withConsole(console)
      )
      expect(out).toEqual([])
      expect(err).toHaveLength(1)
      expect(err[0]).not.toContain("\n")
      expect(err[0]).toContain("guest reported an error")
    }).pipe(Effect.provide(LogToStderr))
  )
})

describe("--json turn events", () => {
  it("carry text when the chunk is valid UTF-8, else base64 of the exact bytes (and no data)", () => {
    expect(
      jsonEvent({ _tag: "Event", event: { kind: "stdout", data: "h\u00e9" }, bytes: Buffer.from("h\u00e9") })
    ).toEqual({ _tag: "Event", event: { kind: "stdout", data: "h\u00e9" } })
    const bytes = Buffer.from([0xff, 0x00, 0x41])
    const binary = jsonEvent({ _tag: "Event", event: { kind: "stderr", data: "\ufffd\u0000A" }, bytes })
    expect(binary).toEqual({ _tag: "Event", event: { kind: "stderr", base64: bytes.toString("base64") } })
    expect(JSON.stringify(jsonEvent({ _tag: "End", exitCode: 0, signal: null, cancelled: false }))).toBe(
      '{"_tag":"End","exitCode":0,"signal":null,"cancelled":false}'
    )
  })
})
