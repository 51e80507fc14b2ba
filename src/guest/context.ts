/**
 * The guest's conversation state, `<state>/context.json` (/var/lib/abox/context.json in a VM):
 * written atomically after each turn, reloaded on the next start so that a resumed session knows
 * its history. A file that does not decode is kept aside (`context.json.corrupt-<time>`), never
 * deleted, and the agent starts with an empty history.
 */
import { constants as fsConstants } from "node:fs"
import * as fs from "node:fs/promises"
import * as path from "node:path"
import * as Either from "effect/Either"
import * as ParseResult from "effect/ParseResult"
import * as Schema from "effect/Schema"

/**
 * 2 adds `messages` (the model conversation, @effect/ai Prompt messages in their encoded JSON
 * form); a format-1 file still loads (no messages).
 */
export const CONTEXT_FORMAT = 2
export const CONTEXT_FILE = "context.json"

export const ContextTurn = Schema.Struct({
  turn: Schema.Number,
  text: Schema.String,
  exitCode: Schema.NullOr(Schema.Number),
  signal: Schema.NullOr(Schema.String),
  cancelled: Schema.Boolean,
  startedAt: Schema.String,
  endedAt: Schema.String
})
export type ContextTurn = typeof ContextTurn.Type

export const ContextFile = Schema.Struct({
  format: Schema.Literal(1, CONTEXT_FORMAT),
  turns: Schema.Array(ContextTurn),
  /** the model conversation; decoded by the model agent when a prompt turn loads it */
  messages: Schema.optional(Schema.Array(Schema.Unknown))
})
export type ContextFile = typeof ContextFile.Type

const decodeContext = Schema.decodeUnknownEither(Schema.parseJson(ContextFile))
const encodeContext = Schema.encodeSync(Schema.parseJson(ContextFile, { space: 2 }))

export interface LoadedContext {
  readonly turns: ReadonlyArray<ContextTurn>
  readonly messages: ReadonlyArray<unknown>
  /** set when a corrupt file was kept aside: where it went and why */
  readonly keptAside?: { readonly path: string; readonly reason: string }
}

const isErrno = (error: unknown, code: string): boolean =>
  typeof error === "object" && error !== null && (error as { code?: unknown }).code === code

/** The state dir belongs to root alone (mode 0700): turn processes can neither read nor write it. */
export const ensureStateDir = async (stateDir: string): Promise<void> => {
  await fs.mkdir(stateDir, { recursive: true, mode: 0o700 })
  await fs.chmod(stateDir, 0o700)
}

export const loadContext = async (
  stateDir: string,
  now: () => Date = () => new Date()
): Promise<LoadedContext> => {
  const file = path.join(stateDir, CONTEXT_FILE)
  let text: string
  try {
    text = await fs.readFile(file, "utf8")
  } catch (error) {
    if (isErrno(error, "ENOENT")) return { turns: [], messages: [] }
    throw error
  }
  const decoded = decodeContext(text)
  if (Either.isRight(decoded)) return { turns: decoded.right.turns, messages: decoded.right.messages ?? [] }
  const aside = `${file}.corrupt-${now().toISOString().replace(/[:.]/g, "-")}`
  await fs.rename(file, aside)
  return {
    turns: [],
    messages: [],
    keptAside: { path: aside, reason: ParseResult.TreeFormatter.formatErrorSync(decoded.left) }
  }
}

/** temp file in the same dir → write → fsync → rename over → fsync the dir */
export const saveContext = async (
  stateDir: string,
  turns: ReadonlyArray<ContextTurn>,
  messages: ReadonlyArray<unknown> = []
): Promise<void> => {
  const file = path.join(stateDir, CONTEXT_FILE)
  const temp = `${file}.tmp-${process.pid}`
  const bytes = encodeContext({ format: CONTEXT_FORMAT, turns, messages }) + "\n"
  const handle = await fs.open(temp, "w", 0o600)
  try {
    await handle.writeFile(bytes, "utf8")
    await handle.sync()
  } finally {
    await handle.close()
  }
  await fs.rename(temp, file)
  // the rename is durable only once the directory entry is: fsync the dir (raw fd: no Effect here)
  const dir = await fs.open(stateDir, fsConstants.O_RDONLY | fsConstants.O_DIRECTORY)
  try {
    await dir.sync()
  } finally {
    await dir.close()
  }
}
