/**
 * The workstation image with a real VM, one boot: every ordinary client in the guest reaches a
 * local HTTPS server (its names given to the broker by the policy's `resolve`) through the
 * guest's proxy and the host's broker, with the host's credentials and the guest holding only
 * placeholders:
 *
 * - `npm ci && npm test` in a repository whose lockfile resolves to a local registry stand-in;
 * - curl, GNU wget, `git clone` (smart HTTP, git http-backend), `npm install` of real tarballs
 *   (the official `openai` and `@anthropic-ai/sdk` packages and their dependencies), `pip
 *   download` of a wheel from a simple index, Node 24's `fetch`;
 * - the `openai` and `@anthropic-ai/sdk` clients making a streamed (SSE) request;
 * - a denied host and plain HTTP: each client reports a 403 with the reason, promptly.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
import { execFileSync } from "node:child_process"
import * as crypto from "node:crypto"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { type BrokerPolicy, presetRules, withRules } from "../src/broker/policy.js"
import { open } from "../src/programs/session.js"
import type { TurnEvent } from "../src/services/GuestRpc.js"
import {
  ensureWorkstationImage,
  repoRoot,
  testHome,
  workstationSkipReason,
  vmSessionLayer
} from "./e2e-vm-image.js"
import {
  makeWheel,
  type NpmPackage,
  packDirectory,
  startWorkstationUpstream
} from "./support/workstationUpstream.js"

const hasGit = (() => {
  try {
    execFileSync("git", ["--version"], { stdio: "ignore" })
    return true
  } catch {
    return false
  }
})()
const skip = workstationSkipReason() ?? (hasGit ? undefined : "git is missing on the host (git http-backend)")
if (skip !== undefined) console.warn(`e2e workstation VM test skipped: ${skip}`)

const DOMAIN = "test.local"
const NAMES = ["files", "registry", "pypi", "git"] as const
/** the APIs keep their real names (the SDKs' default base URLs); the policy's presets and `resolve` bring them here */
const API_NAMES = { "api.openai.com": "openai", "api.anthropic.com": "anthropic" }
const host = (name: string) => `${name}.${DOMAIN}`

/** a package directory in node_modules, looked up as node does from `from` */
const packageDir = (name: string, from: string): string => {
  for (let dir = from; ; dir = path.dirname(dir)) {
    const candidate = path.join(dir, "node_modules", name)
    if (fs.existsSync(path.join(candidate, "package.json"))) return candidate
    if (path.dirname(dir) === dir) throw new Error(`${name} not found from ${from}`)
  }
}

/** the SDKs and their dependencies, as the registry would serve them (their CommonJS runtime) */
const sdkPackages = async (): Promise<ReadonlyArray<NpmPackage>> => {
  const runtime = (relative: string) => !relative.startsWith("src/") && /\.(c?js|json)$/.test(relative)
  const found = new Map<string, string>()
  const visit = (name: string, from: string) => {
    if (found.has(name)) return
    const dir = packageDir(name, from)
    found.set(name, dir)
    const manifest = JSON.parse(fs.readFileSync(path.join(dir, "package.json"), "utf8")) as {
      dependencies?: Record<string, string>
    }
    for (const dependency of Object.keys(manifest.dependencies ?? {})) visit(dependency, dir)
  }
  visit("openai", repoRoot)
  visit("@anthropic-ai/sdk", repoRoot)
  return Promise.all([...found.values()].map((dir) => packDirectory(dir, runtime)))
}

interface Outcome {
  readonly out: string
  readonly exitCode: number | null
}
const outcomeOf = (events: ReadonlyArray<TurnEvent>): Outcome => {
  let out = ""
  let exitCode: number | null = null
  for (const e of events) {
    if (e._tag === "Event" && (e.event.kind === "stdout" || e.event.kind === "stderr")) out += e.event.data
    if (e._tag === "End") exitCode = e.exitCode
  }
  return { out, exitCode }
}

describe.skipIf(skip !== undefined)("workstation image with a real VM", () => {
  it.live(
    "npm ci && npm test, curl, wget, git, npm, pip, fetch, the OpenAI and Anthropic SDKs through the broker; denials are 403s with the reason",
    () =>
      Effect.gen(function* () {
        const image = yield* Effect.promise(() => ensureWorkstationImage())
        const work = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-ws-"))
        yield* Effect.addFinalizer(() => Effect.sync(() => fs.rmSync(work, { recursive: true, force: true })))

        // a tiny package, packed as npm packs it, for the lockfile
        const demoDir = path.join(work, "abox-demo")
        fs.mkdirSync(demoDir)
        fs.writeFileSync(
          path.join(demoDir, "package.json"),
          JSON.stringify({ name: "abox-demo", version: "1.0.0", main: "index.js" })
        )
        fs.writeFileSync(path.join(demoDir, "index.js"), 'module.exports = "abox-demo works"\n')
        const demo = yield* Effect.promise(() => packDirectory(demoDir))
        const sdks = yield* Effect.promise(() => sdkPackages())

        // a bare repository served by git http-backend
        const gitRoot = path.join(work, "git")
        const seed = path.join(work, "seed")
        const git = (cwd: string, ...args: Array<string>) =>
          execFileSync(
            "git",
            ["-c", "user.name=abox", "-c", "user.email=abox@test", "-c", "init.defaultBranch=main", ...args],
            {
              cwd,
              stdio: ["ignore", "pipe", "pipe"]
            }
          )
        fs.mkdirSync(gitRoot)
        fs.mkdirSync(seed)
        git(gitRoot, "init", "-q", "--bare", "demo.git")
        git(seed, "init", "-q")
        fs.writeFileSync(path.join(seed, "README"), "cloned over smart HTTP\n")
        git(seed, "add", "README")
        git(seed, "commit", "-q", "-m", "first")
        git(seed, "push", "-q", path.join(gitRoot, "demo.git"), "HEAD:refs/heads/main")
        git(path.join(gitRoot, "demo.git"), "symbolic-ref", "HEAD", "refs/heads/main")

        const upstream = yield* Effect.acquireRelease(
          Effect.promise(() =>
            startWorkstationUpstream({
              domain: DOMAIN,
              npmPackages: [demo, ...sdks],
              wheel: { project: "abox-demo", ...makeWheel("abox-demo", "0.1.0") },
              gitRoot,
              aliases: API_NAMES
            })
          ),
          (u) => Effect.promise(() => u.close())
        )
        const port = upstream.port
        const origin = (name: string) => `https://${host(name)}:${port}`

        const secrets = {
          ABOX_TEST_FILES_TOKEN: `files-${Math.random().toString(36).slice(2)}`,
          ABOX_TEST_NPM_TOKEN: `npm-${Math.random().toString(36).slice(2)}`,
          ABOX_TEST_PYPI_TOKEN: `pypi-${Math.random().toString(36).slice(2)}`,
          ABOX_TEST_GIT_BASIC: Buffer.from(
            `x-access-token:git-${Math.random().toString(36).slice(2)}`
          ).toString("base64"),
          ABOX_TEST_OPENAI_KEY: `sk-openai-${Math.random().toString(36).slice(2)}`,
          ABOX_TEST_ANTHROPIC_KEY: `sk-ant-${Math.random().toString(36).slice(2)}`
        }
        Object.assign(process.env, secrets)
        yield* Effect.addFinalizer(() =>
          Effect.sync(() => {
            for (const name of Object.keys(secrets)) delete process.env[name]
          })
        )
        const explicit: BrokerPolicy = {
          format: 1,
          allow: NAMES.map((name) => ({ host: host(name), ports: [port] })),
          // every test host is TLS-terminated (the guest trusts the session CA, the broker the test CA)
          credentials: [
            { host: host("files"), header: "x-abox-test-token", fromEnv: "ABOX_TEST_FILES_TOKEN" },
            {
              host: host("registry"),
              header: "authorization",
              fromEnv: "ABOX_TEST_NPM_TOKEN",
              format: "Bearer {}"
            },
            {
              host: host("pypi"),
              header: "authorization",
              fromEnv: "ABOX_TEST_PYPI_TOKEN",
              format: "Bearer {}"
            },
            { host: host("git"), header: "authorization", fromEnv: "ABOX_TEST_GIT_BASIC", format: "Basic {}" }
          ],
          resolve: {
            ...Object.fromEntries(NAMES.map((name) => [host(name), "127.0.0.1"])),
            // the guest asks for api.*.com:443, the broker dials the stand-in
            ...Object.fromEntries(Object.keys(API_NAMES).map((name) => [name, `127.0.0.1:${port}`]))
          }
        }
        const policy = withRules(
          withRules(explicit, presetRules("openai", { fromEnv: "ABOX_TEST_OPENAI_KEY" })),
          presetRules("anthropic", { fromEnv: "ABOX_TEST_ANTHROPIC_KEY" })
        )

        // the repository: a lockfile whose one package comes from the registry stand-in
        const source = path.join(work, "repo")
        fs.mkdirSync(source)
        const manifest = {
          name: "demo-app",
          version: "1.0.0",
          private: true,
          scripts: { test: "node test.js" },
          dependencies: { "abox-demo": "1.0.0" }
        }
        fs.writeFileSync(path.join(source, "package.json"), JSON.stringify(manifest, null, 2))
        fs.writeFileSync(
          path.join(source, "package-lock.json"),
          JSON.stringify(
            {
              name: "demo-app",
              version: "1.0.0",
              lockfileVersion: 3,
              requires: true,
              packages: {
                "": { name: "demo-app", version: "1.0.0", dependencies: { "abox-demo": "1.0.0" } },
                "node_modules/abox-demo": {
                  version: "1.0.0",
                  resolved: upstream.tarballUrl(demo),
                  integrity: `sha512-${crypto.createHash("sha512").update(demo.tarball).digest("base64")}`
                }
              }
            },
            null,
            2
          )
        )
        fs.writeFileSync(path.join(source, ".npmrc"), `registry=${origin("registry")}/\n`)
        fs.writeFileSync(path.join(source, "test.js"), 'console.log("npm test: " + require("abox-demo"))\n')

        const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-ws-home-"))
        fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
        yield* Effect.addFinalizer(() => Effect.sync(() => fs.rmSync(home, { recursive: true, force: true })))
        const layer = vmSessionLayer(home, upstream.caPem)

        const results = yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* open({
              source,
              policy,
              image: `${image.identity.name}@${image.identity.digest}`,
              memoryMiB: 2048
            })
            const took: Array<string> = []
            const run = (text: string) =>
              Effect.gen(function* () {
                const started = Date.now()
                const outcome = outcomeOf(Chunk.toReadonlyArray(yield* Stream.runCollect(session.turn(text))))
                took.push(`${((Date.now() - started) / 1000).toFixed(1)} s`)
                return outcome
              })
            const at = (name: string) => origin(name)
            const results: Record<string, Outcome> = {}
            results.npmCi = yield* run("npm ci --no-audit --no-fund && npm test")
            // venv without pip: ensurepip alone takes minutes under TCG (pip itself is checked by pip download)
            results.tools = yield* run(
              "for t in bash git curl wget make gcc g++ python3 pip3 rg jq less ps unzip zip xz ssh node npm npx; do " +
                'command -v "$t" >/dev/null || echo "missing $t"; done; node --version; ' +
                "python3 -m venv --without-pip /tmp/venv && /tmp/venv/bin/python -c 'print(\"venv ok\")'; " +
                "printf 'int main(void){return 0;}' >/tmp/t.c && gcc -o /tmp/t /tmp/t.c && /tmp/t && echo 'gcc ok'"
            )
            results.env = yield* run("env")
            results.curl = yield* run(`curl -sS ${at("files")}/hello`)
            results.wget = yield* run(`wget -q -O- ${at("files")}/hello`)
            results.git = yield* run(`git clone -q ${at("git")}/demo.git /tmp/clone && cat /tmp/clone/README`)
            results.pip = yield* run(
              `pip download --no-deps --disable-pip-version-check --index-url ${at("pypi")}/simple/ -d /tmp/pip abox-demo && ls /tmp/pip`
            )
            results.fetch = yield* run(
              `node -e 'fetch("${at("files")}/hello").then((r) => r.text()).then((t) => process.stdout.write(t))'`
            )
            results.npmInstall = yield* run(
              `mkdir -p /tmp/sdk && cd /tmp/sdk && npm init -y >/dev/null && ` +
                `npm install --no-audit --no-fund --registry ${at("registry")}/ openai @anthropic-ai/sdk abox-demo && ` +
                `node -p 'require("abox-demo")'`
            )
            results.openai = yield* run(
              `cd /tmp/sdk && node -e '
const { OpenAI } = require("openai")
const client = new OpenAI({ apiKey: process.env.ABOX_TEST_OPENAI_KEY })
;(async () => {
  const stream = await client.chat.completions.create({ model: "gpt-test", messages: [{ role: "user", content: "hi" }], stream: true })
  let chunks = 0
  for await (const chunk of stream) { chunks++; process.stdout.write(chunk.choices[0]?.delta?.content ?? "") }
  console.log(" (" + chunks + " chunks)")
})().catch((e) => { console.log("openai failed: " + e); process.exit(1) })'`
            )
            results.anthropic = yield* run(
              `cd /tmp/sdk && node -e '
const sdk = require("@anthropic-ai/sdk")
const Anthropic = sdk.Anthropic ?? sdk.default
const client = new Anthropic({ apiKey: process.env.ABOX_TEST_ANTHROPIC_KEY })
;(async () => {
  const stream = await client.messages.create({ model: "claude-test", max_tokens: 16, messages: [{ role: "user", content: "hi" }], stream: true })
  let events = 0
  for await (const event of stream) { events++; if (event.type === "content_block_delta") process.stdout.write(event.delta.text) }
  console.log(" (" + events + " events)")
})().catch((e) => { console.log("anthropic failed: " + e); process.exit(1) })'`
            )
            const denied = `https://denied.${DOMAIN}:${port}/`
            results.denied = yield* run(
              `echo "curl: $(curl -sS ${denied} 2>&1)"; ` +
                `echo "curl -v: $(curl -sv ${denied} 2>&1 | grep -i '< HTTP/1.1 403')"; ` +
                `echo "wget: $(wget -O- ${denied} 2>&1 | grep -i forbidden)"; ` +
                `echo "git: $(git ls-remote https://denied.${DOMAIN}:${port}/x.git 2>&1)"; ` +
                `echo "node fetch: $(node -e 'fetch("${denied}").catch((e) => console.log(String(e.cause?.cause?.message ?? e.cause ?? e)))' 2>&1)"; ` +
                `echo "node https: $(node -e 'require("https").get("${denied}").on("error", (e) => console.log(e.message))' 2>&1)"; ` +
                `echo "python: $(python3 -c 'import urllib.request; urllib.request.urlopen("${denied}")' 2>&1 | tail -n 1)"; ` +
                `echo "plain curl: $(curl -sS http://files.${DOMAIN}/ 2>&1)"; ` +
                `echo "plain wget: $(wget -O- http://files.${DOMAIN}/ 2>&1 | grep -i 403)"`
            )
            // where a slow run spends its time (not asserted: the machine's load decides)
            console.log(
              `workstation turns: ${Object.keys(results)
                .map((name, i) => `${name} ${took[i]}`)
                .join(", ")}`
            )
            return results
          })
        ).pipe(Effect.provide(layer))

        const show = (name: string) => `${name}:\n${results[name]?.out}`
        expect(results.npmCi?.exitCode, show("npmCi")).toBe(0)
        expect(results.npmCi?.out).toContain("npm test: abox-demo works")
        expect(results.tools?.out, show("tools")).not.toContain("missing")
        expect(results.tools?.out).toMatch(/^v24\./m)
        expect(results.tools?.out).toContain("venv ok")
        expect(results.tools?.out).toContain("gcc ok")
        // the guest holds placeholders only
        for (const name of Object.keys(secrets))
          expect(results.env?.out).toContain(`${name}=abox-placeholder`)
        for (const value of Object.values(secrets)) expect(results.env?.out).not.toContain(value)
        expect(results.curl, show("curl")).toEqual({ out: "hello from files\n", exitCode: 0 })
        expect(results.wget, show("wget")).toEqual({ out: "hello from files\n", exitCode: 0 })
        expect(results.git, show("git")).toEqual({ out: "cloned over smart HTTP\n", exitCode: 0 })
        expect(results.pip?.exitCode, show("pip")).toBe(0)
        expect(results.pip?.out).toContain("abox_demo-0.1.0-py3-none-any.whl")
        expect(results.fetch, show("fetch")).toEqual({ out: "hello from files\n", exitCode: 0 })
        expect(results.npmInstall?.exitCode, show("npmInstall")).toBe(0)
        expect(results.npmInstall?.out).toContain("abox-demo works")
        expect(results.openai?.exitCode, show("openai")).toBe(0)
        expect(results.openai?.out).toMatch(/hello from openai \([2-9]\d* chunks\)/)
        expect(results.anthropic?.exitCode, show("anthropic")).toBe(0)
        expect(results.anthropic?.out).toMatch(/hello from anthropic \([5-9]\d* events\)/)

        // each denial is a 403 with the reason, not a hang or a name that does not resolve
        const denied = results.denied?.out ?? ""
        expect(denied, denied).not.toMatch(/ENOTFOUND|Could not resolve|Name or service not known/i)
        expect(denied).toMatch(/^curl: .*403/m)
        expect(denied).toMatch(/^curl -v: < HTTP\/1\.1 403 Forbidden \(abox: host-not-allowed\)/m)
        expect(denied).toMatch(/^wget: Proxy tunneling failed: Forbidden \(abox: host-not-allowed\)/m)
        expect(denied).toMatch(/^git: .*CONNECT tunnel failed, response 403/m)
        expect(denied).toMatch(/^node fetch: Proxy response \(403\) !== 200/m)
        expect(denied).toMatch(/^node https: .*403 Forbidden \(abox: host-not-allowed\)/m)
        expect(denied).toMatch(/^python: .*403 Forbidden \(abox: host-not-allowed\)/m)
        expect(denied).toMatch(/^plain curl: Forbidden \(abox: plain-http-not-brokered/m)
        expect(denied).toMatch(/^plain wget: .*403 Forbidden \(abox: plain-http-not-brokered/m)

        // the host's credentials reached each server; never a secret in the guest
        const headersOf = (name: string, header: string) =>
          upstream.seen.filter((r) => r.name === name).map((r) => r.headers[header])
        expect(headersOf("files", "x-abox-test-token")).toContain(secrets.ABOX_TEST_FILES_TOKEN)
        expect(new Set(headersOf("registry", "authorization"))).toEqual(
          new Set([`Bearer ${secrets.ABOX_TEST_NPM_TOKEN}`])
        )
        expect(new Set(headersOf("pypi", "authorization"))).toEqual(
          new Set([`Bearer ${secrets.ABOX_TEST_PYPI_TOKEN}`])
        )
        expect(new Set(headersOf("git", "authorization"))).toEqual(
          new Set([`Basic ${secrets.ABOX_TEST_GIT_BASIC}`])
        )
        expect(headersOf("openai", "authorization")).toEqual([`Bearer ${secrets.ABOX_TEST_OPENAI_KEY}`])
        // the preset's header; the SDK's own `Authorization: Bearer abox-placeholder` was dropped on the host
        expect(headersOf("anthropic", "x-api-key")).toEqual([secrets.ABOX_TEST_ANTHROPIC_KEY])
        expect(headersOf("anthropic", "authorization")).toEqual([undefined])
        // and no placeholder went upstream
        for (const request of upstream.seen)
          expect(JSON.stringify(request.headers), `${request.name} ${request.url}`).not.toContain(
            "abox-placeholder"
          )
      }).pipe(Effect.scoped),
    1_800_000
  )
})
