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

export const CredentialRule = Schema.Union(
  Schema.Struct({
    host: HostName,
    header: HeaderName,
    fromEnv: Schema.String.pipe(Schema.pattern(/^[A-Za-z_][A-Za-z0-9_]*$/)),
    format: Schema.optional(HeaderFormat)
  }),
  Schema.Struct({
    host: HostName,
    header: HeaderName,
    /** absolute, or `~/…` (the host user's home); read at request time, trailing newline dropped */
    fromFile: Schema.String.pipe(Schema.minLength(1)),
    format: Schema.optional(HeaderFormat)
  })
)
export type CredentialRule = typeof CredentialRule.Type

const ResolveAddress = Schema.String.pipe(
  Schema.filter((s) => parseIpLiteral(s) !== undefined || `not an IP address: ${JSON.stringify(s)}`)
)

export const BrokerPolicy = Schema.Struct({
  format: Schema.Literal(BROKER_POLICY_FORMAT),
  allow: Schema.Array(AllowRule),
  credentials: Schema.optionalWith(Schema.Array(CredentialRule), { default: () => [] }),
  /**
   * Pin names to addresses, like curl's --resolve; the only way a name may reach a loopback or
   * private address (test servers, a local model gateway). Chosen by the host, never the guest.
   */
  resolve: Schema.optionalWith(Schema.Record({ key: HostName, value: ResolveAddress }), {
    default: () => ({})
  })
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
      /** from the policy's `resolve` map: dial this without the address-class check */
      readonly pinned: string | undefined
    }

export const decide = (policy: BrokerPolicy, rawHost: string, port: number): PolicyDecision => {
  if (!Number.isInteger(port) || port < 1 || port > 65535) return { allow: false, reason: "invalid-port" }
  const checked = normalizeHost(rawHost)
  if (!checked.ok) return { allow: false, reason: checked.reason }
  const host = checked.host
  const rules = policy.allow.filter((rule) => matchesHostPattern(rule.host, host))
  if (rules.length === 0) return { allow: false, reason: "host-not-allowed" }
  if (!rules.some((rule) => rule.ports.includes(port))) return { allow: false, reason: "port-not-allowed" }
  const credential = policy.credentials.find((rule) => rule.host.toLowerCase() === host)
  const pinnedEntry = Object.entries(policy.resolve).find(([name]) => name.toLowerCase() === host)
  return { allow: true, host, credential, pinned: pinnedEntry?.[1] }
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
