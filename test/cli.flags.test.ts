/**
 * Every boot flag through every command that takes it (open, run, resume), checked where it
 * lands: session.json, guest-config.json (what the guest reads), the VM spec the backend was
 * given (FakeVmm records it), and what the agent actually ran with.
 */
import { describe, expect, it } from "@effect/vitest"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { cliBundle, tempHome, withCliAndSource } from "./cliHelpers.js"

const sourceDir = withCliAndSource()

/** the CLI over the fake backend, with `input` on stdin (a piped, non-terminal stdin) */
const cli = (home: string, args: ReadonlyArray<string>, input = "") => {
  const r = spawnSync(process.execPath, [cliBundle, ...args], {
    env: { PATH: process.env.PATH ?? "", HOME: path.join(home, "user"), ABOX_HOME: home, ABOX_VMM: "fake" },
    input,
    encoding: "utf8",
    timeout: 120_000
  })
  return { code: r.status, stdout: r.stdout, stderr: r.stderr }
}

const readJson = (file: string) => JSON.parse(fs.readFileSync(file, "utf8")) as Record<string, unknown>

const onlySession = (home: string) => {
  const ids = fs.readdirSync(path.join(home, "sessions"))
  expect(ids).toHaveLength(1)
  return ids[0]!
}

/** what each place recorded for the session */
const landed = (home: string, id: string) => {
  const dir = path.join(home, "sessions", id)
  return {
    session: readJson(path.join(dir, "session.json")),
    guestConfig: readJson(path.join(dir, "guest-config.json")),
    vm: readJson(path.join(dir, "fake-guest", "vm-spec.json"))
  }
}

const policyFile = (home: string, host: string) => {
  const file = path.join(home, `policy-${host}.json`)
  fs.writeFileSync(file, JSON.stringify({ format: 1, allow: [{ host, ports: [443] }] }))
  return file
}

/** an agent that says which model it was given and echoes the turn it read on stdin */
const agentFlags = ["--agent", "/bin/sh", "--agent", "-c", "--agent", "echo model={model}; cat"]

const flags = (home: string, n: { model: string; cpus: number; memory: number; host: string }) => [
  "--model",
  n.model,
  "--cpus",
  String(n.cpus),
  "--memory",
  String(n.memory),
  "--policy",
  policyFile(home, n.host),
  ...agentFlags
]

const expectLanded = (
  home: string,
  id: string,
  n: { model: string; cpus: number; memory: number; host: string }
) => {
  const { session, guestConfig, vm } = landed(home, id)
  expect(session).toMatchObject({
    model: n.model,
    resources: { cpus: n.cpus, memoryMiB: n.memory },
    policy: { allow: [{ host: n.host, ports: [443] }] }
  })
  expect(guestConfig).toMatchObject({
    model: n.model,
    agent: { argv: ["/bin/sh", "-c", "echo model={model}; cat"] }
  })
  expect(vm).toMatchObject({ cpus: n.cpus, memoryMiB: n.memory })
}

describe("boot flags reach the session and the VM, on every command", () => {
  it("open (interactive, piped turns)", () => {
    const home = tempHome()
    const n = { model: "open-model", cpus: 3, memory: 640, host: "open.example" }
    const r = cli(home, ["open", ...flags(home, n), sourceDir()], "a turn\n/exit\n")
    expect(r.stderr).not.toContain("Error")
    expect(r.code).toBe(0)
    expect(r.stdout).toContain("model=open-model\na turn")
    expectLanded(home, onlySession(home), n)
  })

  it("run, then resume with other values", () => {
    const home = tempHome()
    const n = { model: "run-model", cpus: 3, memory: 768, host: "run.example" }
    const r = cli(home, ["run", ...flags(home, n), sourceDir(), "--", "one"])
    expect(r.code).toBe(0)
    expect(r.stdout).toBe("model=run-model\none")
    const id = onlySession(home)
    expectLanded(home, id, n)

    const m = { model: "resume-model", cpus: 1, memory: 512, host: "resume.example" }
    const again = cli(home, ["resume", ...flags(home, m), id, "--", "two"])
    expect(again.code).toBe(0)
    expect(again.stdout).toBe("model=resume-model\ntwo")
    expectLanded(home, id, m)
  })
})
