/**
 * Text from the guest (host names it chose, error messages, output) is an attacker's: before it
 * reaches a terminal, control characters become visible escapes so that it can neither move the
 * cursor, rewrite earlier lines, change the title, nor hide text (ESC sequences, C1 CSI U+009B,
 * backspace and carriage return overwrites, bidi overrides).
 */

export interface EscapeOptions {
  /** keep `\n` and `\t` as they are (multi-line output); default: escape them too */
  readonly keepNewlines?: boolean
}

// C0 controls, DEL, C1 controls, and the Unicode bidi embedding/override/isolate controls
const CONTROL = /[\u0000-\u001f\u007f-\u009f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/gu

const NAMED: Readonly<Record<string, string>> = {
  "\n": "\\n",
  "\r": "\\r",
  "\t": "\\t",
  "\b": "\\b",
  "\u001b": "\\e"
}

const escapeOne = (c: string): string => {
  const named = NAMED[c]
  if (named !== undefined) return named
  const code = c.codePointAt(0)!
  return code <= 0xff ? `\\x${code.toString(16).padStart(2, "0")}` : `\\u{${code.toString(16)}}`
}

/**
 * `text` with every control character replaced by a visible escape (`\e`, `\x9b`, `\b`, `\r`,
 * `\u{202e}`, ...). Printable text, including non-ASCII letters, is unchanged; the result never
 * contains a control character (except `\n` and `\t` with `keepNewlines`).
 */
export const escapeControl = (text: string, options: EscapeOptions = {}): string =>
  text.replace(CONTROL, (c) =>
    options.keepNewlines === true && (c === "\n" || c === "\t") ? c : escapeOne(c)
  )

/** True when `text` contains a character `escapeControl` would replace. */
export const hasControl = (text: string): boolean => {
  CONTROL.lastIndex = 0
  const found = CONTROL.test(text)
  CONTROL.lastIndex = 0
  return found
}
