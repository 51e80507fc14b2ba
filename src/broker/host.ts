import { looksLikeIpLiteral } from "./address.js"

/**
 * Host names as the broker compares them: lower case, one trailing dot dropped, letters, digits,
 * `-` and `_` in labels of 1–63 characters, at most 253 characters, never an IP literal.
 */
export type HostCheck =
  { readonly ok: true; readonly host: string } | { readonly ok: false; readonly reason: string }

const LABEL = /^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$/

export const normalizeHost = (raw: string): HostCheck => {
  if (looksLikeIpLiteral(raw)) return { ok: false, reason: "ip-literal" }
  const host = raw.toLowerCase().replace(/\.$/, "")
  if (host.length === 0 || host.length > 253) return { ok: false, reason: "invalid-host" }
  if (!host.split(".").every((label) => LABEL.test(label))) return { ok: false, reason: "invalid-host" }
  return { ok: true, host }
}

/**
 * A policy host pattern: an exact name (`api.example.com`) or `*.` + a suffix that matches on a
 * label boundary, one or more labels deep (`*.github.com` matches `api.github.com` and
 * `a.b.github.com`, never `github.com` itself nor `evilgithub.com`). `host` must be normalised.
 */
export const matchesHostPattern = (pattern: string, host: string): boolean => {
  const p = pattern.toLowerCase().replace(/\.$/, "")
  if (p.startsWith("*.")) {
    const suffix = p.slice(1) // ".github.com"
    return host.length > suffix.length && host.endsWith(suffix)
  }
  return host === p
}

/** A valid pattern: a normal host name, optionally prefixed by `*.`. */
export const isValidHostPattern = (pattern: string): boolean => {
  const body = pattern.startsWith("*.") ? pattern.slice(2) : pattern
  const checked = normalizeHost(body)
  return checked.ok && checked.host === body.toLowerCase() && !body.includes("*")
}
