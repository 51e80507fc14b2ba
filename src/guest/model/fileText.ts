/**
 * What the file tools do to a file's text, apart from how the file is reached: `read_file`'s
 * numbered lines and range, `edit_file`'s replacement (one match, or all of them), and the
 * ledger of files the model has read in this conversation (an edit needs one). Pure functions
 * over strings, so the tools' execution (as the repository owner) stays a separate matter.
 */

/** lines `read_file` returns when the model names no limit */
export const DEFAULT_READ_LINES = 2000
/** a longer line is cut (a minified bundle is one line) */
export const MAX_LINE_CHARS = 2000
/** an edit whose result would be longer is refused (replace_all multiplies a replacement) */
export const MAX_EDIT_RESULT_CHARS = 16 * 1024 * 1024

export type TextResult =
  { readonly ok: true; readonly text: string } | { readonly ok: false; readonly reason: string }

/** a file's lines; a final newline ends the last line rather than starting an empty one */
export const splitLines = (text: string): ReadonlyArray<string> => {
  if (text === "") return []
  const lines = text.split("\n")
  if (lines.at(-1) === "") lines.pop()
  return lines
}

/**
 * Lines `offset`..`offset + limit - 1` (1-based) of `text`, each as `<number>\t<line>` (the
 * number right-aligned, as `cat -n` prints it), then a note when lines remain after the range.
 * A range that starts past the end is an error naming the file's length.
 */
export const numberedLines = (
  text: string,
  offset: number | undefined,
  limit: number | undefined
): TextResult => {
  const lines = splitLines(text)
  const whole = (value: number | undefined, fallback: number) =>
    value !== undefined && Number.isFinite(value) ? Math.max(1, Math.floor(value)) : fallback
  const first = whole(offset, 1)
  const count = whole(limit, DEFAULT_READ_LINES)
  if (lines.length === 0) {
    return first === 1 ? { ok: true, text: "(empty file)" } : { ok: false, reason: "the file is empty" }
  }
  if (first > lines.length) {
    return {
      ok: false,
      reason: `offset ${first} is past the end of the file (${lines.length} line${lines.length === 1 ? "" : "s"})`
    }
  }
  const last = Math.min(lines.length, first - 1 + count)
  const width = String(last).length
  const out: Array<string> = []
  for (let n = first; n <= last; n++) {
    const line = lines[n - 1]!
    const shown =
      line.length > MAX_LINE_CHARS
        ? `${line.slice(0, MAX_LINE_CHARS)}… [line cut: ${line.length} characters]`
        : line
    out.push(`${String(n).padStart(width, " ")}\t${shown}`)
  }
  if (last < lines.length) {
    out.push(`[lines ${first}-${last} of ${lines.length}; read on with offset ${last + 1}]`)
  }
  return { ok: true, text: out.join("\n") }
}

/** non-overlapping occurrences of `needle` (not empty) in `text` */
export const countOccurrences = (text: string, needle: string): number => {
  let count = 0
  for (let at = text.indexOf(needle); at >= 0; at = text.indexOf(needle, at + needle.length)) count++
  return count
}

/**
 * `text` with `oldString` replaced by `newString`: it must occur exactly once, or, with
 * `replaceAll`, at least once (every occurrence is replaced). The reason says how many were found.
 */
export const replaceText = (
  text: string,
  oldString: string,
  newString: string,
  replaceAll: boolean
):
  | (TextResult & { readonly ok: false })
  | { readonly ok: true; readonly text: string; readonly count: number } => {
  if (oldString === "") return { ok: false, reason: "old_string is empty; use write_file to create a file" }
  if (oldString === newString) return { ok: false, reason: "old_string and new_string are the same" }
  const count = countOccurrences(text, oldString)
  if (count === 0) return { ok: false, reason: "old_string was not found" }
  if (count > 1 && !replaceAll) {
    return {
      ok: false,
      reason: `old_string occurs ${count} times; include more context to make it unique, or set replace_all`
    }
  }
  const length = text.length + count * (newString.length - oldString.length)
  if (length > MAX_EDIT_RESULT_CHARS) {
    return {
      ok: false,
      reason: `the edited file would be ${length} characters (at most ${MAX_EDIT_RESULT_CHARS}); use write_file or the shell`
    }
  }
  // split/join: no `$` patterns in the replacement, every occurrence left to right
  return { ok: true, text: text.split(oldString).join(newString), count }
}

/**
 * The files the model has read (or written) in this conversation, by their absolute path in the
 * repository: `edit_file` refuses one that is not here, so an edit is made on text the model saw.
 */
export class ReadLedger {
  private readonly files = new Set<string>()
  add(file: string): void {
    this.files.add(file)
  }
  has(file: string): boolean {
    return this.files.has(file)
  }
}

/**
 * The paths named by the successful `read_file` and `write_file` calls of a conversation (its
 * encoded messages, as context.json keeps them): a resumed session still knows what it read.
 */
export const pathsSeen = (messages: ReadonlyArray<unknown>): ReadonlyArray<string> => {
  const calls = new Map<string, string>()
  const seen: Array<string> = []
  for (const message of messages) {
    if (typeof message !== "object" || message === null) continue
    const content = (message as { content?: unknown }).content
    if (!Array.isArray(content)) continue
    for (const part of content as ReadonlyArray<Record<string, unknown>>) {
      if (part === null || typeof part !== "object") continue
      if (part.type === "tool-call" && (part.name === "read_file" || part.name === "write_file")) {
        const params = part.params as Record<string, unknown> | undefined
        if (typeof part.id === "string" && typeof params?.path === "string") calls.set(part.id, params.path)
      } else if (part.type === "tool-result" && typeof part.id === "string") {
        const file = calls.get(part.id)
        const result = part.result as { isError?: unknown } | undefined
        if (file !== undefined && part.isFailure !== true && result?.isError !== true) seen.push(file)
      }
    }
  }
  return seen
}
