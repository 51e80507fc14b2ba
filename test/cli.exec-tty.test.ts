/**
 * `abox exec -it` with real processes and FakeVmm (the real guest agent as a host process, its
 * tty turns on the host's busybox telnetd): the built CLI runs under a real pseudo-terminal made
 * by util-linux `script`, as a user's terminal would drive it.
 */
import { describe, expect, it } from "@effect/vitest"
import { spawn, spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { exitCodeFor } from "../src/cli/exitCodes.js"
import * as Schema from "effect/Schema"
import { TurnRpcError } from "../src/services/ControlRpc.js"
import { TtyUnsupported } from "../src/services/GuestRpc.js"
import { cliBundle, runCli, tempHome, withCliAndSource } from "./cliHelpers.js"

const fake = { ABOX_VMM: "fake", ABOX_SKIP_SCRUB: "1" }
const source = withCliAndSource()
const haveScript = spawnSync("script", ["--version"]).status === 0
const haveBusybox = fs.existsSync("/bin/busybox")

const quote = (s: string) => `'${s.replace(/'/g, `'\\''`)}'`

describe.skipIf(!haveScript || !haveBusybox)(
  `abox exec -it (FakeVmm, a real pty)${haveScript ? "" : " (skipped: no util-linux script)"}${haveBusybox ? "" : " (skipped: no /bin/busybox)"}`,
  () => {
    it("tty is a pts of the local size and TERM; typed bytes arrive; a resize follows; ^C is 130; the terminal is restored; piped stdin is 64", async () => {
      const home = tempHome()
      const started = runCli(home, ["start", source(), "--name", "t"], fake)
      expect(started.code, started.stderr).toBe(0)
      try {
        // with piped stdin, -it is a usage error; so are -i alone and -t with --prompt
        const piped = spawnSync(process.execPath, [cliBundle, "exec", "-it", "t", "--", "sh"], {
          env: { PATH: process.env.PATH ?? "", HOME: path.join(home, "user"), ABOX_HOME: home, ...fake },
          input: "echo hi\n",
          encoding: "utf8",
          timeout: 30_000
        })
        expect(piped.status, piped.stderr).toBe(64)
        expect(piped.stderr).toContain("the input device is not a TTY")
        expect(runCli(home, ["exec", "-i", "t", "--", "sh"], fake).code).toBe(64)
        expect(runCli(home, ["exec", "-t", "--prompt", "hi", "t"], fake).code).toBe(64)

        const resizeFlag = path.join(home, "resize-now")
        // the guest command: its terminal, then a typed line, then waits until its size changes
        // (the local terminal resized: SIGWINCH → resize), then sleeps until ^C
        const guest =
          'tty; stty size; echo "term=$TERM"; echo ready; read line; echo "got=$line"; ' +
          'while [ "$(stty size)" != "40 100" ]; do sleep 0.1; done; echo resized; sleep 30'
        const cli = `${quote(process.execPath)} ${quote(cliBundle)} exec -it t -- ${quote(guest)}`
        // the local side, on script's pty: a known size, the mode saved before and compared after;
        // (Node also resets its stdin's mode when it exits: this checks what the user sees, not which
        // of the two restored it); a helper resizes the local terminal when the test says so (stty on /dev/tty sends SIGWINCH)
        const local =
          `stty rows 33 cols 101; before=$(stty -g); ` +
          `(while [ ! -e ${quote(resizeFlag)} ]; do sleep 0.1; done; stty rows 40 cols 100 </dev/tty) & ` +
          `exec 3<&0; TERM=xterm-256color ${cli} 0<&3; echo "rc=$?"; ` +
          `[ "$(stty -g)" = "$before" ] && echo restored || echo "not-restored $(stty -g)"`
        const child = spawn("script", ["-qfec", local, "/dev/null"], {
          env: { PATH: process.env.PATH ?? "", HOME: path.join(home, "user"), ABOX_HOME: home, ...fake },
          stdio: ["pipe", "pipe", "pipe"]
        })
        let out = ""
        // line ends as the terminals along the way leave them (the guest's pty and script's own)
        const lines = (text: string) => text.replace(/\r+\n/g, "\n")
        const waiters: Array<() => void> = []
        child.stdout.on("data", (d: Buffer) => {
          out += d.toString()
          for (const w of waiters.splice(0)) w()
        })
        child.stderr.on("data", (d: Buffer) => (out += d.toString()))
        const exited = new Promise<number | null>((resolve) => child.on("exit", (code) => resolve(code)))
        const waitFor = (text: string) =>
          new Promise<void>((resolve, reject) => {
            const timer = setTimeout(() => reject(new Error(`no ${JSON.stringify(text)} in: ${out}`)), 60_000)
            const check = () => {
              if (lines(out).includes(text)) {
                clearTimeout(timer)
                resolve()
              } else waiters.push(check)
            }
            check()
          })
        await waitFor("ready\n")
        child.stdin.write("abc\r")
        await waitFor("got=abc")
        fs.writeFileSync(resizeFlag, "")
        await waitFor("resized\n")
        child.stdin.write("\x03")
        await waitFor("restored")
        child.stdin.end()
        await exited

        expect(lines(out)).toMatch(/\/dev\/pts\/\d+\n33 101\nterm=xterm-256color\nready\n/)
        // typed once, echoed by the guest's terminal (the local one is raw) and read by the command
        expect(lines(out)).toContain("abc\ngot=abc\n")
        expect(lines(out).split("abc").length - 1).toBe(2)
        // ^C went to the guest as a byte: this client got no SIGINT (it would say so and cancel)
        expect(out).toContain("rc=130")
        expect(out).not.toContain("SIGINT")
        expect(out).not.toContain("not-restored")
      } finally {
        expect(runCli(home, ["stop", "t"], fake).code).toBe(0)
      }
    }, 180_000)
  }
)

describe("exec -t against a guest without tty turns", () => {
  it("the supervisor's TtyUnsupported decodes into its class on the client (the Turn RPC's errors): exit 101", () => {
    const error = Schema.decodeUnknownSync(TurnRpcError)({ _tag: "TtyUnsupported", message: "the guest has no tty turns" })
    expect(error).toBeInstanceOf(TtyUnsupported)
    expect(exitCodeFor(error._tag)).toBe(101)
  })
})
