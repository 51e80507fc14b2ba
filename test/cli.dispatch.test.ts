/**
 * The CLI loads only what a command line needs (src/cli/dispatch.ts): a subcommand that never
 * starts a VM runs alone, on the light layer. Here, in-process, each of them against the whole
 * CLI on the full layer: the same help, the same parse errors (text and --json), the same exit.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { type CliRun, lightCommands, loadCli } from "../src/cli/dispatch.js"
import { cli } from "../src/cli/main.js"
import { parsedAtTheEdge } from "../src/cli/render.js"
import { MainLive } from "../src/layers/Main.js"

const fullCli: CliRun = (argv) => cli(argv).pipe(Effect.provide(MainLive))

/** what a run printed (stdout and stderr lines, in order) and how it ended */
const capture = async (run: CliRun, argv: ReadonlyArray<string>) => {
  const lines: Array<string> = []
  const sink =
    (stream: string) =>
    (...args: ReadonlyArray<unknown>) =>
      Effect.sync(() => {
        lines.push(`${stream}: ${args.map(String).join(" ")}`)
      })
  const exit = await Effect.runPromiseExit(
    Console.consoleWith((console) =>
      run(argv).pipe(
        parsedAtTheEdge(argv),
        Effect.withConsole({ ...console, log: sink("out"), error: sink("err") })
      )
    )
  )
  return { lines, exit: Exit.isSuccess(exit) ? "success" : "failure" }
}

describe("a command line that names a light subcommand", () => {
  it("loads that subcommand alone, and prints and fails as the whole CLI does", async () => {
    const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-dispatch-"))
    const saved = process.env["ABOX_HOME"]
    process.env["ABOX_HOME"] = home
    try {
      expect(lightCommands).toContain("list")
      // `abox --version` runs on the light CLI too: the same line
      const version = ["node", "abox", "--version"]
      expect(await capture(await loadCli(version), version)).toEqual(await capture(fullCli, version))
      for (const name of lightCommands) {
        for (const args of [["--help"], ["--bogus"], ["--json", "--bogus"]]) {
          const argv = ["node", "abox", name, ...args]
          const alone = await capture(await loadCli(argv), argv)
          const whole = await capture(fullCli, argv)
          expect({ argv: args, ...alone }).toEqual({ argv: args, ...whole })
          expect(alone.lines.length).toBeGreaterThan(0)
        }
      }
    } finally {
      if (saved === undefined) delete process.env["ABOX_HOME"]
      else process.env["ABOX_HOME"] = saved
      fs.rmSync(home, { recursive: true, force: true })
    }
  }, 120_000)
})
