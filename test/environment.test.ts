/**
 * A repository's environment as read from its directory (src/lib/environment.ts): the file is
 * the repository's, so an attacker's: bad fields are typed errors naming them, paths stay inside,
 * devcontainer.json is JSON with comments; requested hosts are granted only by the user
 * (src/programs/environment.ts `grantedHosts`). The CLI exits non-zero on a bad file.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { DENY_ALL } from "../src/programs/session.js"
import { grantedHosts } from "../src/programs/environment.js"
import { environmentKey, readEnvironment, stripJsonc } from "../src/lib/environment.js"
import { buildCli, removeTempHomes, runCli, tempHome } from "./cliHelpers.js"

const repoWith = (files: Record<string, string>) => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-env-"))
  for (const [file, text] of Object.entries(files)) {
    fs.mkdirSync(path.dirname(path.join(dir, file)), { recursive: true })
    fs.writeFileSync(path.join(dir, file), text)
  }
  return dir
}

describe("stripJsonc", () => {
  it("drops comments and trailing commas, keeps strings (a // in a string is text) and offsets", () => {
    const text = `{
  // a line comment, "with quotes"
  "image": "mcr.microsoft.com/x:1", /* a block
  comment */ "url": "http://a//b", "q": "say \\"//\\"",
  "ports": [3000, 5432,],
}`
    const stripped = stripJsonc(text)
    expect(stripped.length).toBe(text.length)
    expect(JSON.parse(stripped)).toEqual({
      image: "mcr.microsoft.com/x:1",
      url: "http://a//b",
      q: 'say "//"',
      ports: [3000, 5432]
    })
  })
})

describe("readEnvironment", () => {
  it.effect("an environment.json with its defaults: setup .abox/setup.sh, base abox-full", () =>
    Effect.gen(function* () {
      const dir = repoWith({
        ".abox/environment.json": JSON.stringify({ install: "npm ci", env: { A: "1" }, allow: ["registry.npmjs.org"] }),
        ".abox/setup.sh": "apt-get install -y jq\n"
      })
      const environment = yield* readEnvironment(dir)
      expect(environment?.base).toBe("abox-full")
      expect(environment?.setup).toEqual({ command: "/bin/sh '/work/repo/.abox/setup.sh'", script: "apt-get install -y jq\n" })
      expect(environment?.install).toBe("npm ci")
      expect(environment?.env).toEqual({ A: "1" })
      expect(environment?.allow).toEqual(["registry.npmjs.org"])
    })
  )

  it.effect("no environment: undefined", () =>
    Effect.gen(function* () {
      expect(yield* readEnvironment(repoWith({ "README.md": "x" }))).toBeUndefined()
    })
  )

  const refused = (files: Record<string, string>) =>
    Effect.flip(readEnvironment(repoWith(files))).pipe(Effect.map((error) => error))

  it.effect("a field of the wrong type is EnvironmentInvalid naming it", () =>
    Effect.gen(function* () {
      const error = yield* refused({ ".abox/environment.json": JSON.stringify({ cpus: "two" }) })
      expect(error._tag).toBe("EnvironmentInvalid")
      expect(error.field).toBe("cpus")
      expect(error.message).toContain("cpus")
    })
  )

  it.effect("an unknown field, a bad env name, a wildcard host, a setup outside the repository: each refused by name", () =>
    Effect.gen(function* () {
      expect((yield* refused({ ".abox/environment.json": JSON.stringify({ instal: "x" }) })).field).toBe("instal")
      expect((yield* refused({ ".abox/environment.json": JSON.stringify({ env: { "A B": "x" } }) })).field).toBe(
        "env.A B"
      )
      expect((yield* refused({ ".abox/environment.json": JSON.stringify({ allow: ["*.example.org"] }) })).field).toBe(
        "allow.0"
      )
      expect(
        (yield* refused({ ".abox/environment.json": JSON.stringify({ setup: "../../etc/passwd" }) })).field
      ).toBe("setup")
      expect((yield* refused({ ".abox/environment.json": JSON.stringify({ setup: "missing.sh" }) })).field).toBe("setup")
      expect((yield* refused({ ".abox/environment.json": "{ not json" }))._tag).toBe("EnvironmentInvalid")
    })
  )

  it.effect("an environment.json that is a link (out of the repository) is refused", () =>
    Effect.gen(function* () {
      const dir = repoWith({ "README.md": "x" })
      fs.mkdirSync(path.join(dir, ".abox"))
      fs.symlinkSync("/etc/passwd", path.join(dir, ".abox", "environment.json"))
      const error = yield* Effect.flip(readEnvironment(dir))
      expect(error.message).toContain("not a regular file")
    })
  )

  it.effect("a linked .abox directory (pointing out of the repository) is refused, not read", () =>
    Effect.gen(function* () {
      const outside = repoWith({ "environment.json": JSON.stringify({ env: { LEAK: "host file" } }) })
      const dir = repoWith({ "README.md": "x" })
      fs.symlinkSync(outside, path.join(dir, ".abox"))
      const error = yield* Effect.flip(readEnvironment(dir))
      expect(error._tag).toBe("EnvironmentInvalid")
      expect(error.message).toContain("outside the repository")
    })
  )

  it.effect("devcontainer.json with comments: image, onCreate as setup, postCreate as install, env, ports; the rest listed as ignored", () =>
    Effect.gen(function* () {
      const dir = repoWith({
        ".devcontainer/devcontainer.json": `// a devcontainer
{
  "name": "demo",
  "image": "mcr.microsoft.com/devcontainers/base:bookworm", // the base
  /* setup */
  "onCreateCommand": ["sh", "-c", "echo it's set up"],
  "postCreateCommand": { "deps": "npm ci", "build": ["make", "all"] },
  "containerEnv": { "A": "1" },
  "remoteEnv": { "B": "2", },
  "forwardPorts": [3000, "db:5432"],
  "features": { "ghcr.io/devcontainers/features/node:1": {} },
  "customizations": {},
}`
      })
      const environment = yield* readEnvironment(dir)
      expect(environment?.kind).toBe("devcontainer")
      expect(environment?.imageReference).toBe("mcr.microsoft.com/devcontainers/base:bookworm")
      expect(environment?.setup?.command).toBe(`'sh' '-c' 'echo it'\\''s set up'`)
      expect(environment?.install).toBe("(npm ci) && ('make' 'all')")
      expect(environment?.env).toEqual({ A: "1", B: "2" })
      expect(environment?.forward).toEqual([3000])
      expect(environment?.ignored).toEqual(["features", "customizations", 'forwardPorts "db:5432"'])
    })
  )

  it.effect("the key changes with the setup script, the file and the base", () =>
    Effect.gen(function* () {
      const files = { ".abox/environment.json": "{}", ".abox/setup.sh": "echo 1\n" }
      const a = (yield* readEnvironment(repoWith(files)))!
      const b = (yield* readEnvironment(repoWith({ ...files, ".abox/setup.sh": "echo 2\n" })))!
      const c = (yield* readEnvironment(repoWith({ ...files, ".abox/environment.json": '{"cpus":2}' })))!
      const base = "0".repeat(64)
      expect(environmentKey(base, a)).toBe(environmentKey(base, { ...a }))
      expect(new Set([environmentKey(base, a), environmentKey(base, b), environmentKey(base, c), environmentKey("1".repeat(64), a)]).size).toBe(4)
    })
  )
})

describe("grantedHosts: a repository cannot widen its own egress", () => {
  const environment = (allow: ReadonlyArray<string>) =>
    Effect.map(
      readEnvironment(repoWith({ ".abox/environment.json": JSON.stringify({ allow }) })),
      (e) => e!
    )
  const policy = { ...DENY_ALL, allow: [{ host: "registry.npmjs.org", ports: [443] }] }

  it.effect("without consent only what the user's policy allows; the flag, a yes, or a recorded grant give the rest", () =>
    Effect.gen(function* () {
      const env = yield* environment(["registry.npmjs.org", "evil.example"])
      const notices: Array<string> = []
      const onNotice = (line: string) => Effect.sync(() => void notices.push(line))
      expect(yield* grantedHosts(env, policy, { onNotice }, undefined)).toEqual({
        granted: ["registry.npmjs.org"],
        refused: ["evil.example"]
      })
      expect(notices[0]).toContain("evil.example: not granted")
      expect((yield* grantedHosts(env, policy, { allowEnvHosts: true }, undefined)).refused).toEqual([])
      let asked: ReadonlyArray<string> = []
      const no = yield* grantedHosts(
        env,
        policy,
        { consentHosts: (hosts) => Effect.sync(() => ((asked = hosts), false)) },
        undefined
      )
      expect(asked).toEqual(["evil.example"])
      expect(no.refused).toEqual(["evil.example"])
      expect((yield* grantedHosts(env, policy, { consentHosts: () => Effect.succeed(true) }, undefined)).refused).toEqual([])
      expect((yield* grantedHosts(env, policy, {}, ["evil.example"])).refused).toEqual([])
      expect((yield* grantedHosts(env, DENY_ALL, {}, ["evil.example"])).refused).toEqual(["registry.npmjs.org"])
    })
  )
})

describe("the CLI on a bad environment file", () => {
  beforeAll(() => buildCli(), 60_000)
  afterAll(() => removeTempHomes())

  it("env build exits 111 naming the field; open/run fail the same before any VM", () => {
    const home = tempHome()
    const dir = repoWith({ ".abox/environment.json": JSON.stringify({ memory: 12 }) })
    const built = runCli(home, ["env", "build", dir])
    expect(built.code).toBe(111)
    expect(built.stderr).toContain("memory")
    const run = runCli(home, ["run", dir, "--", "true"])
    expect(run.code).toBe(111)
    expect(fs.existsSync(path.join(home, "sessions")) ? fs.readdirSync(path.join(home, "sessions")) : []).toEqual([])
  })
})
