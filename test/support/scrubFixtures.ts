/** Generators and builders for the scrubber tests: planted secrets, sessions on disk. */
import * as fc from "fast-check"
import { createHash } from "node:crypto"
import * as fs from "node:fs"
import * as path from "node:path"
import {
  CONFIG_DISK_ALIGN,
  CONFIG_DISK_HEADER,
  CONFIG_DISK_MAGIC,
  encodeConfigDisk
} from "../../src/protocol/ConfigDisk.js"
import type { GuestConfig } from "../../src/protocol/GuestConfig.js"

const chars = (alphabet: string, min: number, max: number) =>
  fc.string({ unit: fc.constantFrom(...alphabet), minLength: min, maxLength: max })

const ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
const UPPER_DIGIT = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
const URLSAFE = ALNUM + "_-"
const B64 = ALNUM + "+/"

/** a planted secret: `text` goes into the file, `value` must not survive the scrub */
export interface Planted {
  readonly kind: string
  readonly value: string
  /** how it appears in text (`KEY=value`, `Bearer value`, or the value itself) */
  readonly text: string
  /** for field-name secrets: the field, so it can also be planted as a JSON member */
  readonly field?: string
}

const token = (kind: string, value: fc.Arbitrary<string>): fc.Arbitrary<Planted> =>
  value.map((v) => ({ kind, value: v, text: v }))

const SECRET_FIELDS = [
  "password",
  "apiKey",
  "api_key",
  "ANTHROPIC_API_KEY",
  "client_secret",
  "authToken",
  "access_token",
  "credentials",
  "aws_secret_access_key",
  "Authorization",
  "db.passwd",
  "x-api-key"
]

export const plantedSecret: fc.Arbitrary<Planted> = fc.oneof(
  token(
    "anthropic",
    chars(URLSAFE, 20, 60).map((s) => `sk-ant-api03-${s}`)
  ),
  token(
    "openai",
    chars(ALNUM, 48, 48).map((s) => `sk-${s}`)
  ),
  token(
    "openai-project",
    chars(URLSAFE, 40, 80).map((s) => `sk-proj-${s}`)
  ),
  token(
    "github",
    fc.tuple(fc.constantFrom("ghp_", "gho_", "ghs_"), chars(ALNUM, 36, 36)).map(([p, s]) => p + s)
  ),
  token(
    "github-pat",
    fc.tuple(chars(ALNUM, 22, 22), chars(ALNUM, 59, 59)).map(([a, b]) => `github_pat_${a}_${b}`)
  ),
  token(
    "aws-access-key-id",
    chars(UPPER_DIGIT, 16, 16).map((s) => `AKIA${s}`)
  ),
  token(
    "google",
    chars(URLSAFE, 35, 35).map((s) => `AIza${s}`)
  ),
  token(
    "slack",
    fc
      .tuple(
        fc.constantFrom("xoxb", "xoxp", "xoxa", "xoxr"),
        chars("0123456789", 10, 13),
        chars(ALNUM, 24, 24)
      )
      .map(([p, n, s]) => `${p}-${n}-${n}-${s}`)
  ),
  token(
    "stripe",
    chars(ALNUM, 24, 99).map((s) => `sk_live_${s}`)
  ),
  token(
    "huggingface",
    chars(ALNUM, 34, 34).map((s) => `hf_${s}`)
  ),
  token(
    "jwt",
    fc
      .tuple(chars(URLSAFE, 10, 40), chars(URLSAFE, 10, 80), chars(URLSAFE, 20, 60))
      .map(([h, p, s]) => `eyJ${h}.eyJ${p}.${s}`)
  ),
  chars(ALNUM + "._~+/-", 16, 60).map((v) => ({ kind: "bearer", value: v, text: `Bearer ${v}` })),
  fc
    .tuple(fc.constantFrom(...SECRET_FIELDS), chars(B64, 12, 40), fc.constantFrom("=", ": ", "= "))
    .map(([field, v, sep]) => ({ kind: "field", value: v, text: `${field}${sep}${v}`, field })),
  fc
    .tuple(fc.constantFrom(...SECRET_FIELDS), chars(ALNUM + " !#$%()*+,-./:;<=>?@[]^_`{|}~", 12, 40))
    .filter(([, v]) => v.trim().length === v.length && !/^[* ]*$/.test(v))
    .map(([field, v]) => ({
      kind: "field-quoted",
      value: v,
      text: `"${field}": ${JSON.stringify(v)}`,
      field
    }))
)

/** text around a planted secret; separators keep tokens from gluing to what is around them */
export const filler: fc.Arbitrary<string> = fc.oneof(
  fc.string({ maxLength: 40 }),
  fc.constantFrom("", "\n", " ", "model=claude\n", "# config\n", "{", "}", "\t", "note: nothing here\n")
)

export const SEPARATORS = ["\n", " ", "\t", "\n\n"]

/** a valid GuestConfig whose bytes hold no secret (model and ids from a plain alphabet) */
export const cleanGuestConfig: fc.Arbitrary<GuestConfig> = fc.record(
  {
    format: fc.constant(1 as const),
    sessionId: chars("0123456789abcdefghjkmnpqrstvwxyz", 26, 26),
    model: fc.stringMatching(/^[a-z]{1,12}(\.[0-9])?$/),
    agent: fc.record({
      argv: fc.array(fc.stringMatching(/^[a-z0-9./]{1,16}$/), { minLength: 1, maxLength: 4 })
    }),
    brokerCaCert: fc
      .array(chars(B64, 64, 64), { minLength: 3, maxLength: 12 })
      .map((lines) => `-----BEGIN CERTIFICATE-----\n${lines.join("\n")}\n-----END CERTIFICATE-----\n`),
    ignoreShutdown: fc.boolean()
  },
  { requiredKeys: ["format", "sessionId", "model"] }
)

export const guestConfigJson = (value: unknown): Buffer =>
  Buffer.from(JSON.stringify(value, null, 2) + "\n", "utf8")

/** a config disk around arbitrary JSON text (what an older version may have sealed) */
export const rawConfigDisk = (jsonText: string, layout = 1): Buffer => {
  const json = Buffer.from(jsonText, "utf8")
  const size = Math.ceil((CONFIG_DISK_HEADER + json.length) / CONFIG_DISK_ALIGN) * CONFIG_DISK_ALIGN
  const disk = Buffer.alloc(size)
  CONFIG_DISK_MAGIC.copy(disk, 0)
  disk.writeUInt32BE(layout, 8)
  disk.writeUInt32BE(json.length, 12)
  createHash("sha256").update(json).digest().copy(disk, 16)
  json.copy(disk, CONFIG_DISK_HEADER)
  return disk
}

/** writes a session directory (0700) with a config.raw and a guest-config.json */
export const writeSession = (
  sessions: string,
  id: string,
  files: { readonly configRaw?: Uint8Array; readonly guestConfig?: Uint8Array }
): string => {
  const dir = path.join(sessions, id)
  fs.mkdirSync(dir, { recursive: true, mode: 0o700 })
  if (files.configRaw) fs.writeFileSync(path.join(dir, "config.raw"), files.configRaw, { mode: 0o600 })
  if (files.guestConfig)
    fs.writeFileSync(path.join(dir, "guest-config.json"), files.guestConfig, { mode: 0o600 })
  return dir
}

export const cleanSessionFiles = (config: GuestConfig) => ({
  configRaw: encodeConfigDisk(config),
  guestConfig: guestConfigJson(config)
})

/** a session an older version left with secrets in both files (unknown fields, inside strings) */
export const dirtySessionFiles = (id: string, secret: string) => {
  const config = {
    format: 1,
    sessionId: id,
    model: "claude",
    apiKey: secret,
    agent: { argv: ["agent", "--token", secret] }
  }
  return { configRaw: rawConfigDisk(JSON.stringify(config)), guestConfig: guestConfigJson(config) }
}
