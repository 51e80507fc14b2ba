/**
 * Guest console text made safe for the user's terminal: escape sequences (CSI such as a screen
 * clear or `ESC[?7l` wrap-off, OSC titles, DCS/APC strings, two-byte ESC sequences, their 8-bit
 * C1 forms) and other control characters are removed; newlines and tabs stay, CR is dropped
 * (CRLF becomes LF). A state machine over characters, so a sequence split between chunks of a
 * followed log is still removed whole.
 */
type State = "ground" | "esc" | "escInter" | "csi" | "string" | "stringEsc"

/** an unterminated OSC/DCS string gives the terminal back after this many characters */
const STRING_MAX = 4096

export const terminalTextStripper = () => {
  let state: State = "ground"
  let stringLength = 0
  const push = (chunk: string): string => {
    let out = ""
    for (const ch of chunk) {
      const c = ch.codePointAt(0)!
      switch (state) {
        case "ground":
          if (c === 0x1b) state = "esc"
          else if (c === 0x9b) state = "csi"
          else if (c === 0x9d || c === 0x90 || c === 0x98 || c === 0x9e || c === 0x9f) {
            state = "string"
            stringLength = 0
          } else if (c === 0x0a || c === 0x09) out += ch
          else if (c < 0x20 || c === 0x7f || (c >= 0x80 && c <= 0x9f)) {
            // other controls (CR, BS, BEL, …) are dropped
          } else out += ch
          break
        case "esc":
          if (c === 0x5b) state = "csi"
          else if (c === 0x5d || c === 0x50 || c === 0x58 || c === 0x5e || c === 0x5f) {
            state = "string"
            stringLength = 0
          } else if (c >= 0x20 && c <= 0x2f) state = "escInter"
          else state = "ground"
          break
        case "escInter":
          if (!(c >= 0x20 && c <= 0x2f)) state = "ground"
          break
        case "csi":
          if (!(c >= 0x20 && c <= 0x3f)) state = "ground"
          break
        case "string":
          if (c === 0x07 || c === 0x9c) state = "ground"
          else if (c === 0x1b) state = "stringEsc"
          else if (++stringLength > STRING_MAX) state = "ground"
          break
        case "stringEsc":
          state = c === 0x5c ? "ground" : "string"
          break
      }
    }
    return out
  }
  return { push }
}

/** the whole text at once */
export const stripTerminalControls = (text: string): string => terminalTextStripper().push(text)
