import * as Schema from "effect/Schema"
import { forbiddenAddressReason, parseIpLiteral } from "./address.js"
import { isValidHostPattern, matchesHostPattern, normalizeHost } from "./host.js"

/** The broker policy file (docs/broker.md). Deny by default. */
export const BROKER_POLICY_FORMAT = 1

const HostPattern = Schema.String.pipe(
  Schema.filter((s) => isValidHostPattern(s) || `not a host name or *.suffix pattern: ${JSON.stringify(s)}`)
)
const HostName = Schema.String.pipe(
  Schema.filter(
    (s) => (isValidHostPattern(s) && !s.startsWith("*.")) || `not a host name: ${JSON.stringify(s)}`
  )
)
const Port = Schema.Int.pipe(Schema.between(1, 65535))

export const AllowRule = Schema.Struct({
  host: HostPattern,
  ports: Schema.Array(Port).pipe(Schema.minItems(1))
})
export type AllowRule = typeof AllowRule.Type

/** `{}` in `format` stands for the secret; absent, the secret is the whole header value. */
const HeaderFormat = Schema.String.pipe(Schema.filter((s) => s.includes("{}") || "format must contain {}"))
const HeaderName = Schema.String.pipe(Schema.pattern(/^[A-Za-z0-9!#$%&'*+.^_`|~-]+$/))

const EnvName = Schema.String.pipe(Schema.pattern(/^[A-Za-z_][A-Za-z0-9_]*$/))
/** absolute, or `~/…` (the host user's home) */
const HostFile = Schema.String.pipe(Schema.minLength(1))

/**
 * `basicUser`: the header value is `Basic base64(<basicUser>:<value>)` (HTTP basic auth, e.g. git
 * over HTTPS with a token), applied after `format`.
 */
const BasicUser = Schema.String.pipe(
  Schema.filter((s) => (s.length > 0 && !s.includes(":") && !/[\r\n]/.test(s)) || "a user name without ':'")
)

/** a `.` or `..` segment, plain or percent-encoded (`%2e`), or a backslash standing for `/` */
const hasDotSegment = (path: string): boolean => {
  const decoded = path.replace(/%2e/gi, ".")
  return decoded.includes("\\") || decoded.split("/").some((segment) => segment === "." || segment === "..")
}

/** an HTTP method as a request line spells it (upper case: methods are case-sensitive) */
const Method = Schema.String.pipe(
  Schema.filter((s) => /^[A-Z]{1,32}$/.test(s) || `not an upper-case HTTP method: ${JSON.stringify(s)}`)
)
/** a path prefix: origin-form, without query, dot segments or percent-encoding */
const PathPrefix = Schema.String.pipe(
  Schema.filter(
    (s) =>
      (s.startsWith("/") &&
        s.length <= 1024 &&
        /^[A-Za-z0-9\-._~!$&'()*+,;=:@/]*$/.test(s) &&
        !hasDotSegment(s)) ||
      `not a path prefix (/…, no query, no dot segment, no %): ${JSON.stringify(s)}`
  )
)

/**
 * Where a rule's credential applies (docs/broker.md, "Method and path rules"): `methods`, and
 * `paths` prefixes of the request's path. Absent: every method, every path.
 */
const scopeFields = {
  methods: Schema.optional(Schema.Array(Method).pipe(Schema.minItems(1))),
  paths: Schema.optional(Schema.Array(PathPrefix).pipe(Schema.minItems(1)))
}

export const CredentialRule = Schema.Union(
  Schema.Struct({
    host: HostName,
    header: HeaderName,
    fromEnv: EnvName,
    format: Schema.optional(HeaderFormat),
    basicUser: Schema.optional(BasicUser),
    ...scopeFields
  }),
  Schema.Struct({
    host: HostName,
    header: HeaderName,
    /** absolute, or `~/…` (the host user's home); read at request time, trailing newline dropped */
    fromFile: HostFile,
    format: Schema.optional(HeaderFormat),
    basicUser: Schema.optional(BasicUser),
    ...scopeFields
  })
)
export type CredentialRule = typeof CredentialRule.Type

/**
 * Whether a rule's credential goes on a request (`method`, origin-form `target`): undefined when
 * it does, else why not (`method`, `path`). The path is compared as sent, before the query, as a
 * plain prefix; a path a server could read as another one (dot segments, an encoded `/`, `\`,
 * `.` or `%`-escape of any kind) is outside every `paths` rule rather than guessed at.
 */
export const credentialOutside = (
  rule: CredentialRule,
  method: string,
  target: string
): "method" | "path" | undefined => {
  if (rule.methods !== undefined && !rule.methods.includes(method)) return "method"
  if (rule.paths === undefined) return undefined
  const path = target.split("?", 1)[0]!.split("#", 1)[0]!
  if (!path.startsWith("/") || path.includes("%") || path.includes("\\") || hasDotSegment(path)) return "path"
  return rule.paths.some((prefix) => path.startsWith(prefix)) ? undefined : "path"
}

/** the header value for a secret: `format` applied, then basic auth when the rule names a user */
export const credentialHeaderValue = (rule: CredentialRule, secret: string): string => {
  const formatted = rule.format === undefined ? secret : rule.format.replaceAll("{}", secret)
  return rule.basicUser === undefined
    ? formatted
    : `Basic ${Buffer.from(`${rule.basicUser}:${formatted}`, "utf8").toString("base64")}`
}

/** Names of the presets a policy's `credentials` may use instead of spelling hosts and headers. */
export const PRESET_NAMES = ["anthropic", "openai", "github"] as const
export type PresetName = (typeof PRESET_NAMES)[number]

/** Where a preset's secret comes from: the host's environment or a host file. */
export type CredentialSource = { readonly fromEnv: string } | { readonly fromFile: string }

export const PresetRule = Schema.Union(
  Schema.Struct({ preset: Schema.Literal(...PRESET_NAMES), fromEnv: EnvName }),
  Schema.Struct({ preset: Schema.Literal(...PRESET_NAMES), fromFile: HostFile })
)
export type PresetRule = typeof PresetRule.Type

/** What a preset expands to: the allow rules and the credential rules (in this order). */
export interface PolicyRules {
  readonly allow: ReadonlyArray<AllowRule>
  readonly credentials: ReadonlyArray<CredentialRule>
}

/**
 * The rules a preset stands for (docs/broker.md, "Presets"): the API's host on 443, TLS-terminated,
 * with the header its official clients expect.
 * - `anthropic`: api.anthropic.com, `x-api-key: <key>`, on GET and POST under `/v1/`
 * - `openai`: api.openai.com, `Authorization: Bearer <key>`, on GET and POST under `/v1/`
 * - `github`: github.com (git over HTTPS: `Authorization: Basic base64(x-access-token:<token>)`,
 *   GET and POST) and api.github.com (`Authorization: Bearer <token>`)
 */
/** what the model clients call: the versioned API (`/v1/messages`, `/v1/responses`, `/v1/models`, …) */
const MODEL_API_SCOPE = { methods: ["GET", "POST"], paths: ["/v1/"] } as const

export const presetRules = (preset: PresetName, source: CredentialSource): PolicyRules => {
  const from = "fromEnv" in source ? { fromEnv: source.fromEnv } : { fromFile: source.fromFile }
  const https = (host: string): AllowRule => ({ host, ports: [443] })
  switch (preset) {
    case "anthropic":
      return {
        allow: [https("api.anthropic.com")],
        credentials: [{ host: "api.anthropic.com", header: "x-api-key", ...from, ...MODEL_API_SCOPE }]
      }
    case "openai":
      return {
        allow: [https("api.openai.com")],
        credentials: [
          {
            host: "api.openai.com",
            header: "Authorization",
            format: "Bearer {}",
            ...from,
            ...MODEL_API_SCOPE
          }
        ]
      }
    case "github":
      return {
        allow: [https("github.com"), https("api.github.com")],
        credentials: [
          // git over smart HTTP: GET …/info/refs, POST …/git-upload-pack and …/git-receive-pack
          {
            host: "github.com",
            header: "Authorization",
            basicUser: "x-access-token",
            ...from,
            methods: ["GET", "POST"]
          },
          { host: "api.github.com", header: "Authorization", format: "Bearer {}", ...from }
        ]
      }
  }
}

/**
 * `policy` with `rules` added: allow rules not already present, credential rules for hosts that
 * have none yet (a host's first credential rule is the one used).
 */
export const withRules = <
  P extends { readonly allow: ReadonlyArray<AllowRule>; readonly credentials: ReadonlyArray<CredentialRule> }
>(
  policy: P,
  rules: PolicyRules
): P => {
  const allow = [...policy.allow]
  for (const rule of rules.allow) {
    const same = allow.some(
      (a) => a.host.toLowerCase() === rule.host.toLowerCase() && rule.ports.every((p) => a.ports.includes(p))
    )
    if (!same) allow.push(rule)
  }
  const credentials = [...policy.credentials]
  for (const rule of rules.credentials) {
    if (!credentials.some((c) => c.host.toLowerCase() === rule.host.toLowerCase())) credentials.push(rule)
  }
  return { ...policy, allow, credentials }
}

/**
 * `resolve` values: an IP address, or an address and a port (`127.0.0.1:8443`, `[::1]:8443`):
 * the broker dials that port instead of the one the guest asked for.
 */
export const parseResolveTarget = (
  text: string
): { readonly address: string; readonly port: number | undefined } | undefined => {
  const bracketed = /^\[([^\]]+)\](?::(\d{1,5}))?$/.exec(text)
  const withPort = /^([^:[\]]+):(\d{1,5})$/.exec(text)
  const [address, port] =
    bracketed !== null
      ? [bracketed[1]!, bracketed[2]]
      : withPort !== null
        ? [withPort[1]!, withPort[2]]
        : [text, undefined]
  if (parseIpLiteral(address) === undefined) return undefined
  if (port === undefined) return { address, port: undefined }
  const n = Number(port)
  return n >= 1 && n <= 65535 ? { address, port: n } : undefined
}

const ResolveAddress = Schema.String.pipe(
  Schema.filter(
    (s) => parseResolveTarget(s) !== undefined || `not an IP address or address:port: ${JSON.stringify(s)}`
  )
)

/** the loopback addresses a `localHttp` endpoint may name, and what each dials */
const LOOPBACK_HOSTS: Readonly<Record<string, string>> = {
  "127.0.0.1": "127.0.0.1",
  localhost: "127.0.0.1",
  "[::1]": "::1"
}

/** A `localHttp` endpoint, parsed: where the broker dials, the Host it sends, the paths allowed. */
export interface LoopbackEndpoint {
  readonly address: string
  readonly port: number
  /** the Host header the server expects (`127.0.0.1:11434`): what a client on the host sends */
  readonly hostHeader: string
  /** `/v1`, or "" for the whole server */
  readonly pathPrefix: string
}

/**
 * `http://127.0.0.1:<port>[/prefix]` (or `localhost`, `[::1]`) → the endpoint; undefined for
 * anything else (https, another host, user info, a query, a fragment, dot segments, encodings).
 */
export const parseLoopbackEndpoint = (text: string): LoopbackEndpoint | undefined => {
  const match =
    /^http:\/\/(127\.0\.0\.1|localhost|\[::1\])(?::(\d{1,5}))?((?:\/[A-Za-z0-9._~-]+)*)\/?$/i.exec(text)
  if (match === null) return undefined
  const host = match[1]!.toLowerCase()
  const port = match[2] === undefined ? 80 : Number(match[2])
  const pathPrefix = match[3]!
  if (port < 1 || port > 65535) return undefined
  if (pathPrefix.split("/").some((segment) => segment === "." || segment === "..")) return undefined
  return {
    address: LOOPBACK_HOSTS[host]!,
    port,
    hostHeader: match[2] === undefined ? host : `${host}:${port}`,
    pathPrefix
  }
}

/**
 * One plain-HTTP endpoint on the host's loopback: the guest asks for `host:port` (a name of the
 * policy's choosing, never an address), the broker forwards each request whose path is under
 * the endpoint's path to exactly that loopback address and port.
 */
export const LocalHttpRule = Schema.Struct({
  host: HostName,
  port: Port,
  endpoint: Schema.String.pipe(
    Schema.filter(
      (s) =>
        parseLoopbackEndpoint(s) !== undefined ||
        `not http://127.0.0.1|localhost|[::1][:port][/path]: ${JSON.stringify(s)}`
    )
  )
})
export type LocalHttpRule = typeof LocalHttpRule.Type

const policyFields = {
  format: Schema.Literal(BROKER_POLICY_FORMAT),
  allow: Schema.Array(AllowRule),
  /**
   * Pin names to addresses, like curl's --resolve; the only way a name may reach a loopback or
   * private address (test servers, a local model gateway). Chosen by the host, never the guest.
   */
  resolve: Schema.optionalWith(Schema.Record({ key: HostName, value: ResolveAddress }), {
    default: () => ({})
  }),
  /**
   * PEM files (absolute or `~/…`) of extra CAs trusted for upstream connections, besides the
   * system's and the host's NODE_EXTRA_CA_CERTS (a test server, an enterprise TLS proxy).
   */
  upstreamCaFiles: Schema.optional(Schema.Array(HostFile)),
  /**
   * PEM files (absolute or `~/…`) of CAs the guest's clients also trust (curl, git, npm, pip,
   * Node): a network whose TLS is inspected re-signs pass-through hosts with its own CA.
   */
  guestCaFiles: Schema.optional(Schema.Array(HostFile)),
  /**
   * Plain-HTTP endpoints on the host's loopback the guest may reach, each under a name of its
   * own (a keyless local model server: the lifecycle adds the catalog's one); nothing else on
   * the host's loopback opens.
   */
  localHttp: Schema.optional(Schema.Array(LocalHttpRule))
}

/** The policy as the broker uses it: presets expanded into plain allow and credential rules. */
const ExpandedPolicy = Schema.Struct({
  ...policyFields,
  credentials: Schema.optionalWith(Schema.Array(CredentialRule), { default: () => [] })
})

/** The policy file: `credentials` may also hold presets (`{"preset":"anthropic","fromEnv":"…"}`). */
const PolicyFile = Schema.Struct({
  ...policyFields,
  credentials: Schema.optionalWith(Schema.Array(Schema.Union(CredentialRule, PresetRule)), {
    default: () => []
  })
})

/** The broker policy file (docs/broker.md), decoded with its presets expanded. */
export const BrokerPolicy = Schema.transform(PolicyFile, Schema.typeSchema(ExpandedPolicy), {
  strict: true,
  decode: (file) => {
    const plain: typeof ExpandedPolicy.Type = {
      ...file,
      credentials: file.credentials.filter((rule): rule is CredentialRule => !("preset" in rule))
    }
    // presets after the explicit rules: a rule the user spelled out wins for its host
    return file.credentials.reduce(
      (policy, rule) =>
        "preset" in rule
          ? withRules(
              policy,
              presetRules(
                rule.preset,
                "fromEnv" in rule ? { fromEnv: rule.fromEnv } : { fromFile: rule.fromFile }
              )
            )
          : policy,
      plain
    )
  },
  encode: (policy) => policy
})
export type BrokerPolicy = typeof BrokerPolicy.Type
export type BrokerPolicyEncoded = typeof BrokerPolicy.Encoded

export const decodePolicyJson = Schema.decodeUnknown(Schema.parseJson(BrokerPolicy))
export const decodePolicy = Schema.decodeUnknown(BrokerPolicy)

/** The policy's answer for one CONNECT, before any name is resolved. */
export type PolicyDecision =
  | { readonly allow: false; readonly reason: string }
  | {
      readonly allow: true
      readonly host: string
      readonly credential: CredentialRule | undefined
      /** from the policy's `resolve` map: dial this (and this port, if given) without the address-class check */
      readonly pinned: { readonly address: string; readonly port: number | undefined } | undefined
      /** a `localHttp` rule's endpoint: plain HTTP forwarded to that loopback address (no credential) */
      readonly local?: LoopbackEndpoint
    }

export const decide = (policy: BrokerPolicy, rawHost: string, port: number): PolicyDecision => {
  if (!Number.isInteger(port) || port < 1 || port > 65535) return { allow: false, reason: "invalid-port" }
  const checked = normalizeHost(rawHost)
  if (!checked.ok) return { allow: false, reason: checked.reason }
  const host = checked.host
  const local = (policy.localHttp ?? []).find((rule) => rule.host.toLowerCase() === host)
  if (local !== undefined) {
    const endpoint = parseLoopbackEndpoint(local.endpoint)
    if (local.port !== port || endpoint === undefined) return { allow: false, reason: "port-not-allowed" }
    return { allow: true, host, credential: undefined, pinned: undefined, local: endpoint }
  }
  const rules = policy.allow.filter((rule) => matchesHostPattern(rule.host, host))
  if (rules.length === 0) return { allow: false, reason: "host-not-allowed" }
  if (!rules.some((rule) => rule.ports.includes(port))) return { allow: false, reason: "port-not-allowed" }
  const credential = policy.credentials.find((rule) => rule.host.toLowerCase() === host)
  const pinnedEntry = Object.entries(policy.resolve).find(([name]) => name.toLowerCase() === host)
  return {
    allow: true,
    host,
    credential,
    pinned: pinnedEntry === undefined ? undefined : parseResolveTarget(pinnedEntry[1])
  }
}

/**
 * Check a resolver's answer: every address must be global unicast (a name that resolves to one
 * public and one private address is refused). Returns the address to dial, or why not.
 */
export const checkResolved = (
  addresses: ReadonlyArray<string>
): { readonly ok: true; readonly address: string } | { readonly ok: false; readonly reason: string } => {
  if (addresses.length === 0) return { ok: false, reason: "resolve-failed" }
  for (const address of addresses) {
    const why = forbiddenAddressReason(address)
    if (why !== undefined) return { ok: false, reason: `address-${why}` }
  }
  return { ok: true, address: addresses[0]! }
}
