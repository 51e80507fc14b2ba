/**
 * Secret detection and redaction, at byte level and inside decoded JSON.
 *
 * Bytes are scanned as latin1 text: one byte is one character, so a match's offsets are byte
 * offsets and a same-length redaction never moves anything. Every rule matches ASCII only, so
 * multi-byte UTF-8 sequences are never cut.
 *
 * What counts as a secret:
 * - provider keys and tokens by shape: Anthropic `sk-ant-…`, OpenAI `sk-…`/`sk-proj-…`, GitHub
 *   `ghp_`/`gho_`/`ghu_`/`ghs_`/`ghr_`/`github_pat_…`, AWS access key ids `AKIA…`/`ASIA…`,
 *   Google `AIza…`, Slack `xox?-…`, Stripe `sk_live_…`/`rk_live_…` (and `_test_`), Hugging
 *   Face `hf_…`, JWTs `eyJ….….…`, PEM private key blocks;
 * - the token after `Bearer`;
 * - the value of a field whose name contains key/token/secret/passw/pwd/credential/creds/auth
 *   (not "author"), in JSON (`"apiKey": "…"`, also escaped inside a JSON string), `KEY=value`,
 *   `key: value` text. This covers AWS secret access keys (`aws_secret_access_key=…`).
 *
 * Token rules have no left boundary on purpose: a token right after an escape such as `\n` in
 * serialized JSON must still be found. The price is a rare false positive, which only costs a
 * redaction of something that looked like a key.
 */

import { createHash } from "node:crypto"

export interface SecretSpan {
  readonly kind: string
  /** offsets into the scanned text (bytes, when scanning latin1) */
  readonly start: number
  readonly end: number
}

/** changes whenever the detection rules change: a record of "no secret here" is only valid under the same rules */
export const secretRulesVersion = (): string =>
  createHash("sha256")
    .update(["1", PREFILTER.source, TOKEN.source, PRIVATE_KEY.source, BEARER.source, NAMED.source].join("\n"))
    .digest("hex")
    .slice(0, 16)

/** what a redacted character becomes; runs of it are never reported again */
export const FILLER = "*"

const ci = (word: string): string =>
  [...word]
    .map((c) => (/[a-z]/.test(c) ? `[${c}${c.toUpperCase()}]` : c.replace(/[.*+?^${}()|[\]\\-]/g, "\\$&")))
    .join("")

/** name keywords; `auth` but not `author` (while `authorization` counts) */
const NAME_KEYWORD = `(?:${["key", "token", "secret", "passw", "pwd", "credential", "creds"].map(ci).join("|")}|${ci("auth")}(?!${ci("or")}(?!${ci("iz")})))`

/** does a field name look like it holds a secret */
const SECRET_NAME = new RegExp(NAME_KEYWORD)
export const isSecretName = (name: string): boolean => SECRET_NAME.test(name)

const nameKind = (name: string): string => {
  const lower = name.toLowerCase()
  if (/aws|secret_?access/.test(lower) && lower.includes("secret")) return "aws-secret-access-key"
  if (lower.includes("passw") || lower.includes("pwd")) return "field:password"
  if (lower.includes("secret")) return "field:secret"
  if (lower.includes("token")) return "field:token"
  if (lower.includes("credential") || lower.includes("creds")) return "field:credential"
  if (lower.includes("key")) return "field:key"
  return "field:auth"
}

interface Rule {
  readonly kind: string | ((match: RegExpExecArray) => string)
  readonly pattern: RegExp
  /** the capture group that holds the secret; whole match when absent */
  readonly value?: (match: RegExpExecArray) => readonly [number, number] | undefined
}

const tokenKind = (text: string): string => {
  if (text.startsWith("sk-ant-")) return "anthropic-key"
  if (text.startsWith("sk-")) return "openai-key"
  if (text.startsWith("gh") || text.startsWith("github_pat_")) return "github-token"
  if (text.startsWith("AKIA") || text.startsWith("ASIA")) return "aws-access-key-id"
  if (text.startsWith("AIza")) return "google-api-key"
  if (text.startsWith("xox")) return "slack-token"
  if (text.startsWith("sk_") || text.startsWith("rk_")) return "stripe-key"
  if (text.startsWith("hf_")) return "huggingface-token"
  return "jwt"
}

const TOKEN = new RegExp(
  [
    "sk-ant-[A-Za-z0-9_-]{16,}",
    "sk-(?!ant-)[A-Za-z0-9_-]{20,}",
    "gh[pousr]_[A-Za-z0-9]{20,}",
    "github_pat_[A-Za-z0-9_]{20,}",
    "(?:AKIA|ASIA)[A-Z0-9]{16}",
    "AIza[A-Za-z0-9_-]{35}",
    "xox[abposr]-[A-Za-z0-9-]{10,}",
    "[sr]k_(?:live|test)_[A-Za-z0-9]{16,}",
    "hf_[A-Za-z0-9]{30,}",
    "eyJ[A-Za-z0-9_-]{8,}\\.[A-Za-z0-9_-]{8,}\\.[A-Za-z0-9_-]*"
  ].join("|"),
  "g"
)

// PEM private keys: the body may hold real newlines or `\n` escapes (inside a JSON string)
const PRIVATE_KEY = new RegExp(
  `-----BEGIN [A-Z ]{0,24}PRIVATE KEY-----(?:[A-Za-z0-9+/=:,. \\t\\r\\n\\\\]|-(?!----END))*(?:-----END [A-Z ]{0,24}PRIVATE KEY-----)?`,
  "g"
)

const BEARER = new RegExp(`${ci("bearer")}[ \\t]+([A-Za-z0-9._~+/=-]{8,})`, "dg")

const SCHEME = `(?:(?:${["bearer", "basic", "token", "digest"].map(ci).join("|")})[ \\t]+)?`
// a bare value: printable ASCII only (never part of a multi-byte character or a binary header),
// never starting with `=` (base64 padding after a name-like run is not a field)
const BARE_CHAR = `\\s"'\`,;&<>{}()\\[\\]\\\\\\x00-\\x1f\\x7f-\\uffff`
const BARE = `${SCHEME}[^${BARE_CHAR}=][^${BARE_CHAR}]*`
const NAMED = new RegExp(
  `([A-Za-z0-9_.-]{0,48}?${NAME_KEYWORD}[A-Za-z0-9_.-]{0,48})(?:\\\\*["'])?[ \\t]*[:=][ \\t]*` +
    `(?:"((?:[^"\\\\\\x00-\\x1f]|\\\\[^\\x00-\\x1f])*)"|\\\\+"([^"\\x00-\\x1f]*?)\\\\+"|'([^'\\x00-\\x1f]*)'|(${BARE}))`,
  "dg"
)

const BARE_LITERALS = new Set(["null", "true", "false", "undefined", "none", "None"])

const RULES: ReadonlyArray<Rule> = [
  { kind: "private-key", pattern: PRIVATE_KEY },
  { kind: (m) => tokenKind(m[0]), pattern: TOKEN },
  { kind: "bearer-token", pattern: BEARER, value: (m) => m.indices?.[1] },
  {
    kind: (m) => nameKind(m[1] ?? ""),
    pattern: NAMED,
    value: (m) => {
      for (const group of [2, 3, 4, 5]) {
        const range = m.indices?.[group]
        if (range !== undefined) {
          if (group === 5 && BARE_LITERALS.has(m[group] ?? "")) return undefined
          return range
        }
      }
      return undefined
    }
  }
]

/**
 * A cheap superset of every rule: text that does not match this has no secret. Keeps the
 * clean path (every start, every session) to one linear scan per file.
 */
const PREFILTER =
  /key|token|secret|passw|pwd|cred|auth|bearer|sk-|[sr]k_|gh[pousr]_|github_pat_|a[ks]ia|aiza|xox|hf_|eyj/i

const isFiller = (text: string, start: number, end: number): boolean => {
  for (let i = start; i < end; i++) {
    const c = text.charCodeAt(i)
    if (c !== 0x2a && c !== 0x20 && c !== 0x09) return false
  }
  return true
}

/** every secret in `text`, as merged, ordered spans (an overlap keeps both kinds) */
export const findSecrets = (text: string): ReadonlyArray<SecretSpan> => {
  if (!PREFILTER.test(text)) return []
  const spans: Array<SecretSpan> = []
  for (const rule of RULES) {
    rule.pattern.lastIndex = 0
    for (let m = rule.pattern.exec(text); m !== null; m = rule.pattern.exec(text)) {
      if (m[0].length === 0) {
        rule.pattern.lastIndex++
        continue
      }
      const range = rule.value ? rule.value(m) : ([m.index, m.index + m[0].length] as const)
      if (range === undefined || range[1] <= range[0] || isFiller(text, range[0], range[1])) continue
      spans.push({
        kind: typeof rule.kind === "string" ? rule.kind : rule.kind(m),
        start: range[0],
        end: range[1]
      })
    }
  }
  return mergeSpans(spans)
}

const mergeSpans = (spans: ReadonlyArray<SecretSpan>): ReadonlyArray<SecretSpan> => {
  const sorted = [...spans].sort((a, b) => a.start - b.start || b.end - a.end)
  const merged: Array<SecretSpan> = []
  for (const span of sorted) {
    const last = merged[merged.length - 1]
    if (last !== undefined && span.start < last.end) {
      const kinds = new Set([...last.kind.split("+"), span.kind])
      merged[merged.length - 1] = {
        kind: [...kinds].join("+"),
        start: last.start,
        end: Math.max(last.end, span.end)
      }
    } else {
      merged.push(span)
    }
  }
  return merged
}

/** the distinct kinds of a set of spans (never the values) */
export const kindsOf = (spans: ReadonlyArray<SecretSpan>): ReadonlyArray<string> =>
  [...new Set(spans.flatMap((span) => span.kind.split("+")))].sort()

/** replace every span with FILLER characters of the same length */
export const redactText = (text: string, spans: ReadonlyArray<SecretSpan>): string => {
  if (spans.length === 0) return text
  let out = ""
  let at = 0
  for (const span of spans) {
    out += text.slice(at, span.start) + FILLER.repeat(span.end - span.start)
    at = span.end
  }
  return out + text.slice(at)
}

/** byte-level scan: latin1 keeps offsets equal to byte offsets */
export const findSecretsInBytes = (
  bytes: Uint8Array,
  end: number = bytes.byteLength
): ReadonlyArray<SecretSpan> =>
  findSecrets(Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength).toString("latin1", 0, end))

/** a copy of `bytes` with every span overwritten by FILLER bytes; same length */
export const redactBytes = (bytes: Uint8Array, spans: ReadonlyArray<SecretSpan>): Buffer => {
  const out = Buffer.from(bytes)
  for (const span of spans) out.fill(FILLER.charCodeAt(0), span.start, span.end)
  return out
}

export interface JsonScrub {
  readonly value: unknown
  readonly kinds: ReadonlyArray<string>
  readonly count: number
}

/**
 * Scrubs a decoded JSON value: drops every object field whose name looks secret, redacts
 * secrets inside every string (keeping the string's length), keeps everything else in order.
 */
export const scrubJson = (value: unknown): JsonScrub => {
  const kinds = new Set<string>()
  let count = 0
  const walk = (node: unknown): unknown => {
    if (typeof node === "string") {
      const spans = findSecrets(node)
      if (spans.length === 0) return node
      count += spans.length
      for (const kind of kindsOf(spans)) kinds.add(kind)
      return redactText(node, spans)
    }
    if (Array.isArray(node)) return node.map((item) => walk(item))
    if (typeof node === "object" && node !== null) {
      const out: Record<string, unknown> = {}
      for (const [name, child] of Object.entries(node)) {
        if (isSecretName(name)) {
          count++
          kinds.add(nameKind(name))
          continue
        }
        out[name] = walk(child)
      }
      return out
    }
    return node
  }
  const scrubbed = walk(value)
  return { value: scrubbed, kinds: [...kinds].sort(), count }
}
