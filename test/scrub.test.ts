import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Layer from "effect/Layer"
import * as Schema from "effect/Schema"
import * as fc from "fast-check"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import {
  makeSecretScrubberLive,
  SCRUB_CACHE_FILE,
  scrubConfigDisk,
  scrubGuestConfigJson,
  SecretScrubberLive
} from "../src/layers/SecretScrubberLive.js"
import { findSecrets, isSecretName, secretRulesVersion } from "../src/lib/secrets.js"
import { decodeConfigDisk, encodeConfigDisk } from "../src/protocol/ConfigDisk.js"
import { GuestConfig, ModelSpec } from "../src/protocol/GuestConfig.js"
import { BUILTIN_CATALOG, resolveModel } from "../src/lib/models.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { SecretScrubber } from "../src/services/SecretScrubber.js"
import {
  cleanGuestConfig,
  cleanSessionFiles,
  dirtySessionFiles,
  filler,
  guestConfigJson,
  plantedSecret,
  rawConfigDisk,
  SEPARATORS,
  writeSession
} from "./support/scrubFixtures.js"

const RUNS = 300
const isRoot = process.getuid?.() === 0

const has = (bytes: Uint8Array, value: string) => Buffer.from(bytes).includes(Buffer.from(value, "utf8"))
const decodeGuestJson = Schema.decodeUnknownEither(Schema.parseJson(GuestConfig))

/** text with planted secrets between random filler */
const plantedText = fc
  .array(fc.tuple(filler, plantedSecret, fc.constantFrom(...SEPARATORS)), { minLength: 1, maxLength: 4 })
  .map((parts) => ({
    text: parts.map(([before, secret, sep]) => `${before}${sep}${secret.text}${sep}`).join(""),
    secrets: parts.map(([, secret]) => secret)
  }))

/** a valid GuestConfig plus planted secrets: as unknown fields, nested, and inside known strings */
const dirtyGuestConfig = fc
  .tuple(
    cleanGuestConfig,
    fc.array(plantedSecret, { minLength: 1, maxLength: 4 }),
    fc.dictionary(fc.stringMatching(/^[a-z]{1,8}$/), fc.jsonValue({ maxDepth: 2 }), { maxKeys: 3 }),
    fc.constantFrom("field", "nested", "model", "argv", "unknown-string")
  )
  .map(([config, secrets, extra, where]) => {
    const value: Record<string, unknown> = { ...extra, ...config }
    for (const secret of secrets) {
      const asField = secret.field !== undefined && (where === "field" || where === "nested")
      if (asField && where === "field") value[secret.field!] = secret.value
      else if (asField) value["env"] = { [secret.field!]: secret.value, keep: "this" }
      else if (where === "model") value["model"] = `${config.model} ${secret.text}`
      else if (where === "argv") value["agent"] = { argv: ["agent", secret.text, "--flag"] }
      else value["notes"] = `see ${secret.text} here`
    }
    return { value, secrets }
  })

describe("secret detection", () => {
  it("no GuestConfig field name looks secret (the JSON route keeps every known field)", () => {
    const fields = Object.keys(GuestConfig.fields)
    expect(fields.length).toBeGreaterThan(3)
    for (const field of fields) expect(isSecretName(field)).toBe(false)
    for (const name of [
      "apiKey",
      "api_key",
      "password",
      "client_secret",
      "Authorization",
      "authToken",
      "creds"
    ]) {
      expect(isSecretName(name)).toBe(true)
    }
    expect(isSecretName("author")).toBe(false)
  })

  it("no model spec field looks secret: a session's config made from any built-in model is clean", () => {
    // a config the scrubber rewrote would change a running session's config disk under it
    for (const field of Object.keys(ModelSpec.fields)) expect(isSecretName(field)).toBe(false)
    for (const alias of Object.keys(BUILTIN_CATALOG.models)) {
      const modelSpec = resolveModel(BUILTIN_CATALOG, alias)
      expect(modelSpec).toBeDefined()
      const config = { format: 1, sessionId: "s", model: alias, placeholderEnv: [], modelSpec, maxSteps: 40 }
      expect(findSecrets(JSON.stringify(config, null, 2))).toEqual([])
    }
  })

  it("each planted kind is found, never with its value in the reported kinds", () => {
    fc.assert(
      fc.property(plantedSecret, (secret) => {
        const spans = findSecrets(`x ${secret.text} y`)
        expect(spans.length).toBeGreaterThan(0)
        for (const span of spans) expect(span.kind.includes(secret.value)).toBe(false)
      }),
      { numRuns: RUNS }
    )
  })
})

describe("scrubbing bytes (properties)", () => {
  it("text with planted secrets: none survives in either file, same length, idempotent", () => {
    fc.assert(
      fc.property(plantedText, ({ text, secrets }) => {
        const bytes = Buffer.from(text, "utf8")
        for (const scrub of [scrubGuestConfigJson, scrubConfigDisk]) {
          const once = scrub(bytes)
          for (const secret of secrets) expect(has(once.bytes, secret.value)).toBe(false)
          expect(once.changed).toBe(true)
          expect(once.count).toBeGreaterThan(0)
          // not JSON, not a config disk: redacted in place, nothing moves
          expect(once.bytes.byteLength).toBe(bytes.byteLength)
          const twice = scrub(once.bytes)
          expect(twice.changed).toBe(false)
          expect(twice.count).toBe(0)
        }
      }),
      { numRuns: RUNS }
    )
  })

  it("guest-config.json: a valid GuestConfig stays valid, planted secrets and secret fields are gone, other fields stay", () => {
    fc.assert(
      fc.property(dirtyGuestConfig, ({ value, secrets }) => {
        const once = scrubGuestConfigJson(guestConfigJson(value))
        for (const secret of secrets) expect(has(once.bytes, secret.value)).toBe(false)
        expect(once.changed).toBe(true)
        const decoded = decodeGuestJson(Buffer.from(once.bytes).toString("utf8"))
        expect(Either.isRight(decoded)).toBe(true)
        if (Either.isRight(decoded)) {
          expect(decoded.right.sessionId).toBe(value["sessionId"])
          expect(decoded.right.format).toBe(1)
        }
        if ("env" in value) expect(Buffer.from(once.bytes).toString("utf8")).toContain(`"keep": "this"`)
        expect(scrubGuestConfigJson(once.bytes).changed).toBe(false)
      }),
      { numRuns: RUNS }
    )
  })

  it("config.raw that decodes: rewritten through the codec, still decodes, secrets gone, idempotent", () => {
    fc.assert(
      fc.property(dirtyGuestConfig, ({ value, secrets }) => {
        const disk = rawConfigDisk(JSON.stringify(value))
        expect(Either.isRight(decodeConfigDisk(disk))).toBe(true)
        const once = scrubConfigDisk(disk)
        for (const secret of secrets) expect(has(once.bytes, secret.value)).toBe(false)
        const decoded = decodeConfigDisk(once.bytes)
        expect(Either.isRight(decoded)).toBe(true)
        if (Either.isRight(decoded)) expect(decoded.right.sessionId).toBe(value["sessionId"])
        expect(scrubConfigDisk(once.bytes).changed).toBe(false)
      }),
      { numRuns: RUNS }
    )
  })

  it("config.raw that does not decode: redacted in place (same length), a valid header keeps its checksum valid", () => {
    fc.assert(
      fc.property(plantedText, fc.constantFrom(0, 1, 7), ({ text, secrets }, layout) => {
        // an older layout, or layout 1 with content that is not a GuestConfig
        const disk = rawConfigDisk(text, layout)
        const once = scrubConfigDisk(disk)
        for (const secret of secrets) expect(has(once.bytes, secret.value)).toBe(false)
        expect(once.bytes.byteLength).toBe(disk.byteLength)
        expect(Buffer.from(once.bytes).subarray(0, 16).equals(disk.subarray(0, 16))).toBe(true)
        const problem = decodeConfigDisk(once.bytes)
        expect(Either.isLeft(problem)).toBe(true)
        if (layout === 1 && Either.isLeft(problem)) expect(problem.left._tag).toBe("InvalidConfig")
        expect(scrubConfigDisk(once.bytes).changed).toBe(false)
      }),
      { numRuns: RUNS }
    )
  })

  it("a secret left in a decodable config disk's padding is removed too", () => {
    const disk = encodeConfigDisk({ format: 1, sessionId: "s", model: "m" })
    const secret = "sk-ant-api03-" + "Q".repeat(40)
    disk.write(secret, disk.length - 200, "latin1")
    const once = scrubConfigDisk(disk)
    expect(has(once.bytes, secret)).toBe(false)
    expect(Either.isRight(decodeConfigDisk(once.bytes))).toBe(true)
  })

  it("clean files stay byte-identical", () => {
    fc.assert(
      fc.property(cleanGuestConfig, (config) => {
        const { configRaw, guestConfig } = cleanSessionFiles(config)
        for (const [scrub, bytes] of [
          [scrubConfigDisk, configRaw],
          [scrubGuestConfigJson, guestConfig]
        ] as const) {
          const result = scrub(bytes)
          expect(result.changed).toBe(false)
          expect(result.count).toBe(0)
          expect(Buffer.from(result.bytes).equals(bytes)).toBe(true)
        }
      }),
      { numRuns: RUNS }
    )
  })
})

// ---- the layer over real directories ----

const makeHomes = Effect.acquireRelease(
  Effect.sync(() => {
    const root = fs.mkdtempSync(path.join(os.tmpdir(), "abox-scrub-"))
    const home = path.join(root, "abox")
    const userHome = path.join(root, "user")
    const sessions = path.join(home, "sessions")
    const legacy = path.join(userHome, "Library", "Application Support", "ABox", "sessions")
    fs.mkdirSync(sessions, { recursive: true })
    fs.mkdirSync(legacy, { recursive: true })
    return { root, home, userHome, sessions, legacy }
  }),
  ({ root }) => Effect.sync(() => fs.rmSync(root, { recursive: true, force: true }))
)

const scrubberAt = (home: string, userHome: string, layer = SecretScrubberLive) =>
  SecretScrubber.pipe(
    Effect.provide(
      layer.pipe(Layer.provide(aboxPathsAt(home, userHome)), Layer.provide(NodeFileSystem.layer))
    )
  )

interface CacheRecord {
  rules: string
  files: Record<string, string>
}
const readCacheRecord = (home: string): CacheRecord =>
  Schema.decodeUnknownSync(
    Schema.parseJson(
      Schema.Struct({
        rules: Schema.String,
        files: Schema.Record({ key: Schema.String, value: Schema.String })
      })
    )
  )(fs.readFileSync(path.join(home, SCRUB_CACHE_FILE), "utf8"))

const snapshot = (dir: string): Record<string, string> => {
  const out: Record<string, string> = {}
  for (const entry of fs.readdirSync(dir, { recursive: true, withFileTypes: true })) {
    const full = path.join(entry.parentPath, entry.name)
    out[path.relative(dir, full)] = entry.isDirectory() ? "<dir>" : fs.readFileSync(full).toString("base64")
  }
  return out
}

describe("SecretScrubberLive", () => {
  it.scoped("scrubs both homes, reports kinds not values, never removes anything, and is idempotent", () =>
    Effect.gen(function* () {
      const { home, userHome, sessions, legacy } = yield* makeHomes
      const secret = "sk-ant-api03-" + "abcDEF123_-".repeat(5)
      const config = { format: 1 as const, sessionId: "clean1", model: "claude" }
      writeSession(sessions, "clean1", cleanSessionFiles(config))
      writeSession(sessions, "dirty1", dirtySessionFiles("dirty1", secret))
      writeSession(legacy, "old1", dirtySessionFiles("old1", secret))
      writeSession(sessions, "empty", {})
      fs.writeFileSync(path.join(sessions, "stray-file"), "not a session")
      const cleanBefore = fs.readFileSync(path.join(sessions, "clean1", "config.raw"))
      const cleanStat = fs.statSync(path.join(sessions, "clean1", "guest-config.json"))
      const scrubber = yield* scrubberAt(home, userHome)

      // dry run: reports, changes nothing
      const before = { sessions: snapshot(sessions), legacy: snapshot(legacy) }
      const dry = yield* scrubber.scrub({ dryRun: true })
      expect(dry.dryRun).toBe(true)
      expect(dry.findings.map((f) => [f.sessionId, path.basename(f.path), f.legacy, f.changed])).toEqual([
        ["dirty1", "config.raw", false, false],
        ["dirty1", "guest-config.json", false, false],
        ["old1", "config.raw", true, false],
        ["old1", "guest-config.json", true, false]
      ])
      expect({ sessions: snapshot(sessions), legacy: snapshot(legacy) }).toEqual(before)

      const report = yield* scrubber.scrub({ dryRun: false })
      expect(report.sessionsScanned).toBe(4)
      expect(report.filesScanned).toBe(6)
      expect(report.problems).toEqual([])
      expect(report.findings).toHaveLength(4)
      for (const finding of report.findings) {
        expect(finding.changed).toBe(true)
        expect(finding.kinds).toContain("anthropic-key")
        expect(finding.kinds).toContain("field:key")
        expect(JSON.stringify(finding)).not.toContain(secret)
      }
      for (const dir of [path.join(sessions, "dirty1"), path.join(legacy, "old1")]) {
        for (const file of ["config.raw", "guest-config.json"]) {
          const bytes = fs.readFileSync(path.join(dir, file))
          expect(bytes.includes(secret)).toBe(false)
          expect(fs.statSync(path.join(dir, file)).mode & 0o777).toBe(0o600)
        }
        expect(Either.isRight(decodeConfigDisk(fs.readFileSync(path.join(dir, "config.raw"))))).toBe(true)
      }
      // every session dir, every file is still there; no temp file left behind
      for (const id of ["clean1", "dirty1", "empty"])
        expect(fs.statSync(path.join(sessions, id)).isDirectory()).toBe(true)
      expect(fs.readdirSync(path.join(sessions, "dirty1")).sort()).toEqual([
        "config.raw",
        "guest-config.json"
      ])
      expect(fs.existsSync(path.join(sessions, "stray-file"))).toBe(true)
      // the clean session was not touched
      expect(fs.readFileSync(path.join(sessions, "clean1", "config.raw")).equals(cleanBefore)).toBe(true)
      expect(fs.statSync(path.join(sessions, "clean1", "guest-config.json")).mtimeMs).toBe(cleanStat.mtimeMs)

      const after = { sessions: snapshot(sessions), legacy: snapshot(legacy) }
      const again = yield* scrubber.scrub({ dryRun: false })
      expect(again.findings).toEqual([])
      expect(again.problems).toEqual([])
      expect({ sessions: snapshot(sessions), legacy: snapshot(legacy) }).toEqual(after)
    })
  )

  it.scoped("no homes at all is an empty report", () =>
    Effect.gen(function* () {
      const root = fs.mkdtempSync(path.join(os.tmpdir(), "abox-scrub-none-"))
      yield* Effect.addFinalizer(() => Effect.sync(() => fs.rmSync(root, { recursive: true, force: true })))
      const scrubber = yield* scrubberAt(path.join(root, "abox"), path.join(root, "user"))
      const report = yield* scrubber.scrub({ dryRun: false })
      expect(report).toEqual({
        dryRun: false,
        sessionsScanned: 0,
        filesScanned: 0,
        findings: [],
        problems: []
      })
    })
  )

  it.scoped.skipIf(isRoot)("an unreadable file is a problem, and the scrub goes on past it", () =>
    Effect.gen(function* () {
      const { home, userHome, sessions } = yield* makeHomes
      const secret = "ghp_" + "A1b2C3d4E5".repeat(4)
      writeSession(sessions, "a-locked", dirtySessionFiles("a-locked", secret))
      writeSession(sessions, "b-open", dirtySessionFiles("b-open", secret))
      const locked = path.join(sessions, "a-locked", "config.raw")
      fs.chmodSync(locked, 0o000)
      yield* Effect.addFinalizer(() => Effect.sync(() => fs.chmodSync(locked, 0o600)))
      const scrubber = yield* scrubberAt(home, userHome)
      const report = yield* scrubber.scrub({ dryRun: false })
      expect(report.problems.map((p) => p.path)).toEqual([locked])
      expect(report.findings.map((f) => `${f.sessionId}/${path.basename(f.path)}`)).toEqual([
        "a-locked/guest-config.json",
        "b-open/config.raw",
        "b-open/guest-config.json"
      ])
      expect(fs.existsSync(locked)).toBe(true)
    })
  )

  it.scopedLive(
    "the clean-file record skips unchanged files, never a changed one, and only under the same rules",
    () =>
      Effect.gen(function* () {
        const { home, userHome, sessions, legacy } = yield* makeHomes
        writeSession(sessions, "c1", cleanSessionFiles({ format: 1, sessionId: "c1", model: "claude" }))
        writeSession(legacy, "c2", cleanSessionFiles({ format: 1, sessionId: "c2", model: "claude" }))
        const rawFile = path.join(sessions, "c1", "config.raw")
        const jsonFile = path.join(legacy, "c2", "guest-config.json")

        // default margin: files written a moment ago are not recorded yet
        const fresh = yield* scrubberAt(home, userHome)
        yield* fresh.scrub({ dryRun: false })
        expect(fs.existsSync(path.join(home, SCRUB_CACHE_FILE))).toBe(false)

        const scrubber = yield* scrubberAt(home, userHome, makeSecretScrubberLive({ cacheMarginMs: 0 }))
        const first = yield* scrubber.scrub({ dryRun: false })
        expect(first.findings).toEqual([])
        const record = readCacheRecord(home)
        expect(record.rules).toBe(secretRulesVersion())
        expect(Object.keys(record.files).sort()).toEqual(
          [
            rawFile,
            path.join(sessions, "c1", "guest-config.json"),
            path.join(legacy, "c2", "config.raw"),
            jsonFile
          ].sort()
        )

        // file timestamps tick coarsely (a few ms); step past one tick so the writes below get new ones
        yield* Effect.sleep("30 millis")
        // same size, written in place (same inode): an older version's secret
        const secret = "sk-ant-api03-" + "Z".repeat(30)
        const dirty = rawConfigDisk(
          JSON.stringify({ format: 1, sessionId: "c1", model: "claude", apiKey: secret })
        )
        expect(dirty.length).toBe(fs.statSync(rawFile).size)
        const fd = fs.openSync(rawFile, "r+")
        fs.writeSync(fd, dirty, 0, dirty.length, 0)
        fs.closeSync(fd)
        fs.appendFileSync(jsonFile, `\nANTHROPIC_API_KEY=${secret}\n`)

        const second = yield* scrubber.scrub({ dryRun: false })
        expect(second.findings.map((f) => f.path).sort()).toEqual([jsonFile, rawFile].sort())
        expect(fs.readFileSync(rawFile).includes(secret)).toBe(false)
        expect(fs.readFileSync(jsonFile).includes(secret)).toBe(false)
        expect(second.filesScanned).toBe(4)

        // a record made under other rules is not trusted; under the same rules it is (that is the speed-up)
        yield* Effect.sleep("30 millis")
        fs.appendFileSync(jsonFile, `\nANTHROPIC_API_KEY=${secret}\n`)
        const forged = (rules: string) =>
          fs.writeFileSync(
            path.join(home, SCRUB_CACHE_FILE),
            JSON.stringify({
              format: 1,
              rules,
              files: {
                [jsonFile]: `${fs.statSync(jsonFile).dev}:${fs.statSync(jsonFile).ino}:${fs.statSync(jsonFile).size}:${fs.statSync(jsonFile).mtimeMs}:${fs.statSync(jsonFile).ctimeMs}`
              }
            })
          )
        forged(secretRulesVersion())
        const trusted = yield* scrubber.scrub({ dryRun: true })
        expect(trusted.findings.map((f) => f.path)).not.toContain(jsonFile)
        forged("older-rules")
        const distrusted = yield* scrubber.scrub({ dryRun: true })
        expect(distrusted.findings.map((f) => f.path)).toContain(jsonFile)
      })
  )
})
