/**
 * The interactive mode on a real pseudo-terminal (util-linux `script`), over the fake backend:
 * the step display, turns streamed at the prompt, Ctrl-C cancelling the running turn (not the
 * session), /exit closing, and transcript.json on the host.
 */
import { describe, expect, it } from "@effect/vitest"
import { spawn, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { cliBundle, tempHome, withCliAndSource } from "./cliHelpers.js"

const hasScript = spawnSync("script", ["--version"]).status === 0
if (!hasScript) console.warn("util-linux `script` is missing: the interactive test is skipped")

const sourceDir = withCliAndSource()

describe.skipIf(!hasScript)("abox open (interactive, on a terminal)", () => {
  it("turns at the prompt, Ctrl-C cancels the running turn, /exit closes; transcript.json kept", async () => {
    const home = tempHome()
    const child = spawn(
      "script",
      ["-qfec", `${process.execPath} ${cliBundle} open ${sourceDir()}`, "/dev/null"],
      {
        env: {
          PATH: process.env.PATH ?? "",
          HOME: path.join(home, "user"),
          ABOX_HOME: home,
          ABOX_VMM: "fake",
          TERM: "dumb"
        },
        stdio: ["pipe", "pipe", "pipe"]
      }
    )
    let screen = ""
    const waiters: Array<{ text: string; count: number; resolve: () => void }> = []
    const occurrences = (text: string) => screen.split(text).length - 1
    child.stdout.on("data", (d: Buffer) => {
      screen += d.toString()
      for (const w of waiters.splice(0)) {
        if (occurrences(w.text) >= w.count) w.resolve()
        else waiters.push(w)
      }
    })
    /** until `text` has appeared `count` times on the terminal */
    const until = (text: string, count = 1) =>
      new Promise<void>((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error(`never saw ${text} ×${count}:\n${screen}`)), 30_000)
        const done = () => {
          clearTimeout(timer)
          resolve()
        }
        if (occurrences(text) >= count) done()
        else waiters.push({ text, count, resolve: done })
      })
    const exited = new Promise<number | null>((resolve) => child.on("exit", (code) => resolve(code)))

    await until("abox> ")
    expect(screen).toMatch(/snapshot\s+\d+\.\d\ds/)
    expect(screen).toMatch(/transfer\s+\d+\.\d\ds/)
    // Ctrl-C at an empty prompt is a hint, not a close
    child.stdin.write("\x03")
    await until("Ctrl-D or /exit closes the session;")
    await until("abox> ", 2)
    child.stdin.write("/help\n")
    await until("do not carry over")
    child.stdin.write("!echo first-turn\n")
    await until("first-turn\r\n")
    await until("abox> ", 4)
    child.stdin.write("!echo started; sleep 60\n")
    await until("started\r\n")
    child.stdin.write("\x03")
    await until("cancelled")
    await until("abox> ", 5)
    child.stdin.write("!echo after-cancel > new-file.txt; echo after-cancel\n")
    await until("after-cancel\r\n")
    await until("abox> ", 6)
    // the holder of the running session shows its diff
    child.stdin.write("/diff --stat\n")
    await until("new-file.txt | 1 +")
    await until("abox> ", 7)
    // a line without ! is a prompt: with no key on this host the broker refuses the model's host
    child.stdin.write("hello agent\n")
    await until("host-not-allowed")
    await until("abox> ", 8)
    child.stdin.write("/exit\n")
    expect(await exited).toBe(0)

    const id = fs.readdirSync(path.join(home, "sessions")).find((d) => !d.startsWith("."))!
    const transcript = JSON.parse(
      fs.readFileSync(path.join(home, "sessions", id, "transcript.json"), "utf8")
    ) as {
      entries: Array<{ text: string; output: string; exitCode: number; cancelled: boolean }>
    }
    expect(transcript.entries.map((e) => [e.text, e.exitCode, e.cancelled])).toEqual([
      ["echo first-turn", 0, false],
      ["echo started; sleep 60", 130, true],
      ["echo after-cancel > new-file.txt; echo after-cancel", 0, false],
      ["hello agent", 1, false]
    ])
    expect(transcript.entries[3]).toMatchObject({ mode: "prompt", agent: { end: { reason: "error" } } })
    expect(transcript.entries[0]!.output).toBe("first-turn\n")
    const meta = JSON.parse(fs.readFileSync(path.join(home, "sessions", id, "session.json"), "utf8")) as {
      lastClose: { how: string }
    }
    expect(meta.lastClose.how).toBe("graceful")
  })
})
