/**
 * The repository's own instructions for agents: every `AGENTS.md` and `CLAUDE.md` in the
 * repository (a few levels deep, `.git` and `node_modules` skipped), nearest the root first,
 * go into the system prompt of each prompt turn, at most `INSTRUCTIONS_MAX_CHARS` characters in
 * all (what does not fit is named, not sent). The files are found and read by processes run as
 * the repository owner (the tree is theirs to shape: a symlink to the agent's state reads as
 * they would read it), fresh at each turn so that an edit of them counts from the next turn.
 */
import * as Effect from "effect/Effect"
import { runProcess, type ToolEnvironment } from "./tools.js"

export const INSTRUCTION_FILES = ["AGENTS.md", "CLAUDE.md"] as const
/** characters of instructions the system prompt takes at most (Codex's default is 32 KiB) */
export const INSTRUCTIONS_MAX_CHARS = 32 * 1024
/** instruction files read at most (each is a process): the rest are named, not read */
export const INSTRUCTIONS_MAX_FILES = 32
/** how deep below the repository root instruction files are looked for */
export const INSTRUCTIONS_MAX_DEPTH = 4
const FIND_TIMEOUT = "10 seconds"

export interface InstructionFile {
  /** relative to the repository root, without `./` */
  readonly path: string
  /** undefined: not read (past the cap or the count) */
  readonly text: string | undefined
}

const depthOf = (file: string) => file.split("/").length
const rankOf = (file: string) => INSTRUCTION_FILES.indexOf(file.split("/").at(-1) as never)

/** nearest the root first; in one directory AGENTS.md before CLAUDE.md; then by path */
export const orderInstructionFiles = (paths: ReadonlyArray<string>): ReadonlyArray<string> =>
  [...paths].sort((a, b) => {
    const dirA = a.split("/").slice(0, -1).join("/")
    const dirB = b.split("/").slice(0, -1).join("/")
    return depthOf(a) - depthOf(b) || (dirA < dirB ? -1 : dirA > dirB ? 1 : 0) || rankOf(a) - rankOf(b)
  })

/**
 * The system prompt's section for these files (in order), `cap` characters of their text at
 * most: a file that does not fit is cut, the ones after it named as left out. Undefined: none.
 */
export const instructionsSection = (
  files: ReadonlyArray<InstructionFile>,
  cap: number = INSTRUCTIONS_MAX_CHARS
): string | undefined => {
  const kept = files.flatMap((file) =>
    file.text !== undefined && file.text.trim() !== "" ? [{ path: file.path, text: file.text }] : []
  )
  const unread = files.flatMap((file) => (file.text === undefined ? [file.path] : []))
  if (kept.length === 0) return undefined
  const left: Array<string> = []
  const parts: Array<string> = [
    "# Repository instructions",
    "The repository's own instruction files follow, nearest the repository root first. A file in a subdirectory applies to the work under that directory; where two disagree, the deeper one wins for its directory."
  ]
  let budget = cap
  for (let i = 0; i < kept.length; i++) {
    const file = kept[i]!
    if (budget <= 0) {
      left.push(...kept.slice(i).map((f) => f.path))
      break
    }
    const text = file.text.length > budget ? file.text.slice(0, budget) : file.text
    parts.push(`## ${file.path}\n${text.trimEnd()}`)
    if (file.text.length > budget) {
      parts.push(`[${file.path} cut: instructions are capped at ${cap} characters]`)
      left.push(...kept.slice(i + 1).map((f) => f.path))
      break
    }
    budget -= text.length
  }
  left.push(...unread)
  if (left.length > 0) parts.push(`[not included: ${left.join(", ")}]`)
  return parts.join("\n\n")
}

/** find and read the instruction files as the owner; a failure to find or read one leaves it out */
export const readInstructions = (
  tools: ToolEnvironment,
  cap: number = INSTRUCTIONS_MAX_CHARS
): Effect.Effect<ReadonlyArray<InstructionFile>> =>
  Effect.gen(function* () {
    const names = INSTRUCTION_FILES.flatMap((name, i) => (i === 0 ? ["-name", name] : ["-o", "-name", name]))
    const found = yield* runProcess(
      { ...tools, outputCap: 256 * 1024 },
      [
        "find",
        ".",
        "-maxdepth",
        String(INSTRUCTIONS_MAX_DEPTH + 1),
        "(",
        "-name",
        ".git",
        "-o",
        "-name",
        "node_modules",
        ")",
        "-prune",
        "-o",
        "-type",
        "f",
        "(",
        ...names,
        ")",
        "-print0"
      ],
      tools.repoDir
    ).pipe(Effect.timeoutOption(FIND_TIMEOUT))
    if (found._tag === "None" || found.value.truncated) return []
    const paths = orderInstructionFiles(
      found.value.output
        .split("\0")
        .filter((entry) => entry.startsWith("./"))
        .map((entry) => entry.slice(2))
    )
    const files: Array<InstructionFile> = []
    let budget = cap
    for (const file of paths) {
      // past the cap a file is only named: its text would not be sent
      if (budget <= 0 || files.length >= INSTRUCTIONS_MAX_FILES) {
        files.push({ path: file, text: undefined })
        continue
      }
      const read = yield* runProcess(
        { ...tools, outputCap: budget + 1 },
        ["head", "-c", String(budget + 1), "--", file],
        tools.repoDir
      ).pipe(Effect.timeoutOption(FIND_TIMEOUT))
      if (read._tag === "None" || read.value.exitCode !== 0) continue
      files.push({ path: file, text: read.value.output })
      budget -= read.value.output.length
    }
    return files
  })
