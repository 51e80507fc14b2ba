import * as ParseResult from "effect/ParseResult"

/** `allow[0].ports[1]`: a path into a JSON document, as people write it */
const formatPath = (path: ReadonlyArray<PropertyKey>): string =>
  path
    .map((key, i) => (typeof key === "number" ? `[${key}]` : `${i === 0 ? "" : "."}${String(key)}`))
    .join("")

/**
 * A decode failure in words: which field is wrong and how (`allow[0].ports[0]: Expected a number
 * between 1 and 65535, actual 0`), at most `limit` of them, instead of Schema's tree of its own
 * internals. For messages about files the user wrote (policies, session.json, image records).
 */
export const describeParseError = (error: ParseResult.ParseError, limit = 3): string => {
  const issues = ParseResult.ArrayFormatter.formatErrorSync(error)
  const lines = [
    ...new Set(
      issues.map((issue) => {
        const where = formatPath(issue.path)
        if (issue._tag === "Missing") return where === "" ? "a field is missing" : `${where} is missing`
        return where === "" ? issue.message : `${where}: ${issue.message}`
      })
    )
  ]
  const more = lines.length > limit ? ` (and ${lines.length - limit} more)` : ""
  return lines.slice(0, limit).join("; ") + more
}
