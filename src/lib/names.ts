/**
 * Session names (seed 001): one JSON file per name under `names/`, the file name derived from
 * the name with every character outside `[A-Za-z0-9_-]` replaced by `_`. Different names can
 * sanitise to the same file; the binding file keeps the original name so that such a
 * collision is refused instead of overwriting.
 */
import { isSessionId } from "./ids.js"

export const NAME_MAX_LENGTH = 128

export type NameProblem = "empty" | "dot" | "too-long" | "control-character" | "session-id"

/** `null` when the name is acceptable, else why not */
export const nameProblem = (name: string): NameProblem | null => {
  if (name.length === 0) return "empty"
  if (name === "." || name === "..") return "dot"
  if ([...name].length > NAME_MAX_LENGTH) return "too-long"
  if (/[\u0000-\u001f\u007f]/.test(name)) return "control-character"
  // refs resolve ids first: a name shaped like an id would be shadowed by (or shadow) a session
  if (isSessionId(name)) return "session-id"
  return null
}

export const describeNameProblem = (name: string, problem: NameProblem): string => {
  switch (problem) {
    case "empty":
      return "a session name cannot be empty"
    case "dot":
      return `"${name}" cannot be a session name`
    case "too-long":
      return `a session name has at most ${NAME_MAX_LENGTH} characters`
    case "control-character":
      return "a session name cannot contain control characters"
    case "session-id":
      return `"${name}" has the shape of a session id, which refs resolve first: choose another name`
  }
}

/**
 * The file stem for a name. One `_` per code point (not per UTF-16 unit), so the stem of a
 * valid name is never longer than NAME_MAX_LENGTH characters. Idempotent.
 */
export const sanitiseName = (name: string): string =>
  Array.from(name, (c) => (/^[A-Za-z0-9_-]$/.test(c) ? c : "_")).join("")

export const NAME_FILE_PATTERN = /^[A-Za-z0-9_-]+$/
