/**
 * The model agent's tools (docs/protocol.md "Agent events"), each run as the unprivileged
 * repository owner in the repository, with a timeout, an output cap (head and tail kept, the
 * cut said) and cancellation that kills the process group:
 *
 * - `shell`: `/bin/sh -c <command>` (git is used through it). Not named `bash`: @effect/ai-anthropic
 *   takes a tool of that name for Anthropic's provider-defined bash tool.
 * - `read_file` (numbered lines, a range of them), `write_file`, `edit_file` (an exact replacement
 *   that must match once, or every match with `replace_all`; only of a file read in this
 *   conversation): each open, read and write is done by a child process running as the owner
 *   (./ownerFiles.ts), so the kernel checks it as the owner's own; a special file (FIFO, device,
 *   socket) is refused, and a slow one blocks only that child, which the timeout or a cancel kills.
 * - `list_files`, `search`: ripgrep when the image has it, else find / grep.
 *
 * Paths are taken relative to the repository (or as /work/repo/…); anything that resolves
 * outside it — `..`, an absolute path elsewhere, a symlink out — is refused.
 */
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import * as Tool from "@effect/ai/Tool"
import * as Toolkit from "@effect/ai/Toolkit"
import * as Clock from "effect/Clock"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import { GUEST_REPO_PATH } from "../agent.js"
import { killGroup } from "../processGroup.js"
import type { TurnUser } from "../user.js"
import { FileOpChild, killAllFileOps, type FileOpError } from "./ownerFiles.js"
import { DEFAULT_READ_LINES, numberedLines, ReadLedger, replaceText } from "./fileText.js"

/** characters of tool output the model sees at most (half head, half tail) */
export const DEFAULT_OUTPUT_CAP = 30_000
export const DEFAULT_SHELL_TIMEOUT_S = 120
export const MAX_SHELL_TIMEOUT_S = 1800
const FILE_TOOL_TIMEOUT = Duration.seconds(30)
const READ_FILE_MAX_BYTES = 4 * 1024 * 1024
/** the largest file edit_file reads (it must hold the whole text) */
const EDIT_FILE_MAX_BYTES = 16 * 1024 * 1024

/** what every tool returns to the model */
export const ToolOutput = Schema.Struct({
  output: Schema.String,
  exitCode: Schema.NullOr(Schema.Number),
  truncated: Schema.Boolean,
  isError: Schema.Boolean,
  durationMs: Schema.Number
})
export type ToolOutput = typeof ToolOutput.Type

const PathParam = Schema.String.annotations({
  description: "a path relative to the repository root (or absolute under /work/repo)"
})

export const ShellTool = Tool.make("shell", {
  description:
    "Run a shell command (/bin/sh -c) in the repository as the repository's owner. Use it for git, builds and tests. " +
    "Output (stdout and stderr together) is capped; long output keeps its head and tail.",
  parameters: {
    command: Schema.String,
    timeout_seconds: Schema.optional(Schema.Number).annotations({
      description: `seconds before the command is killed (default ${DEFAULT_SHELL_TIMEOUT_S})`
    })
  },
  success: ToolOutput
})
export const ReadFileTool = Tool.make("read_file", {
  description:
    "Read a text file, optionally a range of lines (1-based). Each line comes as its number, a tab, then the line " +
    "(the number is not part of the file: leave it out of edit_file's strings).",
  parameters: {
    path: PathParam,
    offset: Schema.optional(Schema.Number).annotations({ description: "first line to read (1-based)" }),
    limit: Schema.optional(Schema.Number).annotations({
      description: `lines to read (default ${DEFAULT_READ_LINES})`
    })
  },
  success: ToolOutput
})
export const WriteFileTool = Tool.make("write_file", {
  description: "Create or overwrite a file with the given content (parent directories are created).",
  parameters: { path: PathParam, content: Schema.String },
  success: ToolOutput
})
export const EditFileTool = Tool.make("edit_file", {
  description:
    "Replace an exact string in a file read with read_file in this conversation. old_string must occur exactly once " +
    "(include enough context to make it unique), unless replace_all is set: then every occurrence is replaced.",
  parameters: {
    path: PathParam,
    old_string: Schema.String,
    new_string: Schema.String,
    replace_all: Schema.optional(Schema.Boolean).annotations({
      description: "replace every occurrence of old_string (default false: it must be unique)"
    })
  },
  success: ToolOutput
})
export const ListFilesTool = Tool.make("list_files", {
  description: "List the files under a directory of the repository (recursively, .git excluded).",
  parameters: { path: Schema.optional(PathParam) },
  success: ToolOutput
})
export const SearchTool = Tool.make("search", {
  description: "Search file contents for a regular expression; prints file:line:text.",
  parameters: { pattern: Schema.String, path: Schema.optional(PathParam) },
  success: ToolOutput
})

export const AgentToolkit = Toolkit.make(
  ShellTool,
  ReadFileTool,
  WriteFileTool,
  EditFileTool,
  ListFilesTool,
  SearchTool
)

/** head and tail of a byte stream, `cap` characters in all; the middle is counted, not kept */
export class OutputCollector {
  private head = ""
  private tail = ""
  private total = 0
  constructor(private readonly cap: number) {}

  push(text: string): void {
    this.total += text.length
    const half = Math.floor(this.cap / 2)
    if (this.head.length < half) {
      const room = half - this.head.length
      this.head += text.slice(0, room)
      text = text.slice(room)
    }
    if (text.length > 0) {
      this.tail = (this.tail + text).slice(-(this.cap - half))
    }
  }

  result(): { readonly output: string; readonly truncated: boolean } {
    const kept = this.head.length + this.tail.length
    if (this.total <= kept) return { output: this.head + this.tail, truncated: false }
    return {
      output: `${this.head}\n[… ${this.total - kept} characters cut; head and tail kept …]\n${this.tail}`,
      truncated: true
    }
  }
}

/** cap a whole string the same way */
export const capText = (text: string, cap: number) => {
  const collector = new OutputCollector(cap)
  collector.push(text)
  return collector.result()
}

export interface ToolEnvironment {
  readonly repoDir: string
  /** the repository owner (root only); undefined: tools run as the agent's own user */
  readonly user: TurnUser | undefined
  /** the turn environment (PATH, HOME, proxy variables, placeholders) */
  readonly env: Readonly<Record<string, string>>
  readonly outputCap?: number
  /** the files read in this conversation (edit_file needs one); default: a new, empty one */
  readonly ledger?: ReadLedger
  /** the owner's child for file operations (the caller ends it); default: one of these handlers' own */
  readonly files?: FileOpChild
}

/** process groups of running tools, for a synchronous last-resort kill (SIGTERM to the agent) */
const liveGroups = new Set<number>()
export const killAllTools = (): void => {
  for (const pid of liveGroups) killGroup(pid, "SIGKILL")
  killAllFileOps()
}

export interface ProcessResult {
  readonly exitCode: number | null
  readonly signal: string | null
  readonly output: string
  readonly truncated: boolean
}

/**
 * One process as the owner, in its own process group; stdout and stderr interleaved into one
 * capped output. Interrupting the effect (cancel, timeout) SIGKILLs the group; when the process
 * exits, whatever it left running in its group is killed too.
 */
export const runProcess = (
  tools: ToolEnvironment,
  argv: ReadonlyArray<string>,
  cwd: string
): Effect.Effect<ProcessResult> =>
  Effect.async<ProcessResult>((resume) => {
    const collector = new OutputCollector(tools.outputCap ?? DEFAULT_OUTPUT_CAP)
    const user = tools.user
    let child: ReturnType<typeof spawn>
    try {
      child = spawn(argv[0]!, argv.slice(1), {
        cwd,
        env: tools.env,
        detached: true,
        stdio: ["ignore", "pipe", "pipe"],
        ...(user === undefined ? {} : { uid: user.uid, gid: user.gid })
      })
    } catch (error) {
      resume(
        Effect.succeed({
          exitCode: 127,
          signal: null,
          output: `cannot start: ${String(error)}`,
          truncated: false
        })
      )
      return
    }
    const pid = child.pid
    if (pid !== undefined) liveGroups.add(pid)
    const decoderOut = new TextDecoder()
    const decoderErr = new TextDecoder()
    child.stdout!.on("data", (chunk: Buffer) => collector.push(decoderOut.decode(chunk, { stream: true })))
    child.stderr!.on("data", (chunk: Buffer) => collector.push(decoderErr.decode(chunk, { stream: true })))
    let done = false
    child.once("error", (error) => {
      if (done) return
      done = true
      resume(
        Effect.succeed({
          exitCode: 127,
          signal: null,
          output: `cannot start: ${error.message}`,
          truncated: false
        })
      )
    })
    child.once("exit", (code, signal) => {
      killGroup(child.pid, "SIGKILL")
      if (pid !== undefined) liveGroups.delete(pid)
      // the pipes close once every holder is gone; a process that left the group is not waited for
      let closed = 0
      const finish = () => {
        if (done) return
        done = true
        clearTimeout(bound)
        resume(Effect.succeed({ exitCode: code, signal, ...collector.result() }))
      }
      const bound = setTimeout(() => {
        child.stdout?.destroy()
        child.stderr?.destroy()
        finish()
      }, 500)
      const onClose = () => {
        if (++closed === 2) finish()
      }
      if (child.stdout!.readableEnded) onClose()
      else child.stdout!.once("close", onClose)
      if (child.stderr!.readableEnded) onClose()
      else child.stderr!.once("close", onClose)
    })
    return Effect.sync(() => {
      done = true
      killGroup(child.pid, "SIGKILL")
      if (pid !== undefined) liveGroups.delete(pid)
      child.stdout?.destroy()
      child.stderr?.destroy()
    })
  })

/** a path as the model names it → an absolute path inside the repository, or why not */
export const resolveRepoPath = (
  repoDir: string,
  requested: string
): { readonly ok: true; readonly path: string } | { readonly ok: false; readonly reason: string } => {
  const repo = path.resolve(repoDir)
  const normalized = path.posix.normalize(requested === "" ? "." : requested)
  const lexical =
    normalized === GUEST_REPO_PATH || normalized.startsWith(GUEST_REPO_PATH + "/")
      ? path.join(repo, normalized.slice(GUEST_REPO_PATH.length))
      : path.resolve(repo, normalized)
  const inside = (candidate: string, root: string) =>
    candidate === root || candidate.startsWith(root + path.sep)
  const refuse = { ok: false as const, reason: `${requested} is outside the repository (${GUEST_REPO_PATH})` }
  if (!inside(lexical, repo)) return refuse
  // a symlink on the way must not lead out: the deepest existing ancestor's real path decides
  let realRepo: string
  try {
    realRepo = fs.realpathSync(repo)
  } catch {
    return refuse
  }
  let existing = lexical
  for (;;) {
    try {
      const real = fs.realpathSync(existing)
      return inside(real, realRepo) ? { ok: true, path: lexical } : refuse
    } catch {
      const parent = path.dirname(existing)
      if (parent === existing) return refuse
      existing = parent
    }
  }
}

const hasRipgrep = (env: Readonly<Record<string, string>>): boolean =>
  (env["PATH"] ?? "").split(":").some((dir) => dir !== "" && fs.existsSync(path.join(dir, "rg")))

/** one repository file's operations, each done by a child running as the owner */
interface OwnerFiles {
  /** at most `max + 1` bytes (more than `max`: the file is longer); `follow`: a final symlink is followed */
  readonly read: (max: number, follow: boolean) => Effect.Effect<Buffer, FileOpError>
  /** create or truncate, then write; `parents`: missing parent directories are created */
  readonly write: (content: string, parents: boolean) => Effect.Effect<void, FileOpError>
}

/** the toolkit's handlers over one environment; every result carries its time */
export const makeHandlers = (tools: ToolEnvironment) => {
  const child = tools.files ?? new FileOpChild(tools.user, tools.repoDir)
  const ownerFiles = (file: string): OwnerFiles => ({
    read: (max, follow) => child.run({ op: "read", path: file, max, follow }),
    write: (content, parents) => Effect.asVoid(child.run({ op: "write", path: file, content, parents }))
  })
  const cap = tools.outputCap ?? DEFAULT_OUTPUT_CAP
  const ledger = tools.ledger ?? new ReadLedger()
  const timed = (effect: Effect.Effect<Omit<ToolOutput, "durationMs">>): Effect.Effect<ToolOutput> =>
    Effect.gen(function* () {
      const started = yield* Clock.currentTimeMillis
      const result = yield* effect
      const ended = yield* Clock.currentTimeMillis
      return { ...result, durationMs: ended - started }
    })
  const fail = (output: string) => ({ output, exitCode: null, truncated: false, isError: true })
  const ok = (output: string) => ({ ...capText(output, cap), exitCode: null, isError: false })
  /** an operation on a repository path, its file operations done by the owner's child */
  const inRepo = (
    requested: string,
    operation: (owner: OwnerFiles, absolute: string) => Effect.Effect<Omit<ToolOutput, "durationMs">, FileOpError>
  ): Effect.Effect<ToolOutput> =>
    timed(
      Effect.suspend(() => {
        const resolved = resolveRepoPath(tools.repoDir, requested)
        if (!resolved.ok) return Effect.succeed(fail(`refused: ${resolved.reason}`))
        // relative to the repository, the child's working directory
        const file = path.relative(tools.repoDir, resolved.path) || "."
        return operation(ownerFiles(file), resolved.path).pipe(
          Effect.timeoutOption(FILE_TOOL_TIMEOUT),
          Effect.map(
            Option.getOrElse(() =>
              fail(
                `timed out after ${Duration.format(Duration.decode(FILE_TOOL_TIMEOUT))}; the file operation was killed`
              )
            )
          ),
          Effect.catchTag("FileOpError", (error) => Effect.succeed(fail(error.message)))
        )
      })
    )
  const processTool = (
    argv: ReadonlyArray<string>,
    cwd: string,
    timeout: Duration.DurationInput,
    okExit: (code: number | null) => boolean = (code) => code === 0
  ) =>
    timed(
      runProcess(tools, argv, cwd).pipe(
        Effect.timeoutOption(timeout),
        Effect.map(
          Option.match({
            onNone: () =>
              fail(
                `timed out after ${Duration.format(Duration.decode(timeout))}; the process group was killed`
              ),
            onSome: (result) => ({
              output:
                result.output +
                (result.signal !== null
                  ? `\n[killed by ${result.signal}]`
                  : result.exitCode !== 0
                    ? `\n[exit ${result.exitCode}]`
                    : ""),
              exitCode: result.exitCode,
              truncated: result.truncated,
              isError: !okExit(result.exitCode)
            })
          })
        )
      )
    )
  const searchRoot = (requested: string | undefined) => resolveRepoPath(tools.repoDir, requested ?? ".")
  /**
   * `argv` in `dir` (checked inside the repository), the directory entered by the owner's own
   * shell: the spawn enters its cwd before the uid changes, so a directory swapped for a symlink
   * after the check would be entered with root's rights; from the repository, `cd` is the owner's
   */
  const inDirAsOwner = (dir: string, argv: ReadonlyArray<string>): ReadonlyArray<string> => [
    "/bin/sh",
    "-c",
    'cd -- "$0" && exec "$@"',
    path.relative(tools.repoDir, dir) || ".",
    ...argv
  ]

  return AgentToolkit.of({
    shell: ({ command, timeout_seconds }) =>
      processTool(
        ["/bin/sh", "-c", command],
        tools.repoDir,
        Duration.seconds(
          Math.min(Math.max(timeout_seconds ?? DEFAULT_SHELL_TIMEOUT_S, 1), MAX_SHELL_TIMEOUT_S)
        )
      ),
    read_file: ({ path: requested, offset, limit }) =>
      inRepo(requested, (owner, absolute) =>
        Effect.map(owner.read(READ_FILE_MAX_BYTES, false), (bytes) => {
          const read = bytes.length
          const text = bytes.subarray(0, Math.min(read, READ_FILE_MAX_BYTES)).toString("utf8")
          const lines = numberedLines(text, offset, limit)
          if (!lines.ok) return fail(`${requested}: ${lines.reason}`)
          ledger.add(absolute)
          const note =
            read > READ_FILE_MAX_BYTES
              ? `\n[file larger than ${READ_FILE_MAX_BYTES} bytes; the rest was not read]`
              : ""
          return ok(lines.text + note)
        })
      ),
    write_file: ({ path: requested, content }) =>
      inRepo(requested, (owner, absolute) =>
        Effect.map(owner.write(content, true), () => {
          // the model knows what it wrote: an edit of it needs no read first
          ledger.add(absolute)
          return ok(`wrote ${Buffer.byteLength(content)} bytes to ${requested}`)
        })
      ),
    edit_file: ({ path: requested, old_string, new_string, replace_all }) =>
      inRepo(requested, (owner, absolute) =>
        Effect.gen(function* () {
          if (!ledger.has(absolute)) {
            return fail(`refused: read ${requested} with read_file before editing it`)
          }
          const bytes = yield* owner.read(EDIT_FILE_MAX_BYTES, true)
          if (bytes.length > EDIT_FILE_MAX_BYTES) {
            return fail(`${requested} is larger than ${EDIT_FILE_MAX_BYTES} bytes; edit it with the shell`)
          }
          const edited = replaceText(bytes.toString("utf8"), old_string, new_string, replace_all === true)
          if (!edited.ok) return fail(`${requested}: ${edited.reason}`)
          yield* owner.write(edited.text, false)
          return ok(`edited ${requested}${edited.count === 1 ? "" : ` (${edited.count} occurrences replaced)`}`)
        })
      ),
    list_files: ({ path: requested }) => {
      const root = searchRoot(requested)
      if (!root.ok) return timed(Effect.succeed(fail(`refused: ${root.reason}`)))
      const argv = hasRipgrep(tools.env)
        ? ["rg", "--files", "--hidden", "--glob", "!.git", "."]
        : ["find", ".", "-path", "./.git", "-prune", "-o", "-type", "f", "-print"]
      return processTool(inDirAsOwner(root.path, argv), tools.repoDir, FILE_TOOL_TIMEOUT)
    },
    search: ({ pattern, path: requested }) => {
      const root = searchRoot(requested)
      if (!root.ok) return timed(Effect.succeed(fail(`refused: ${root.reason}`)))
      const argv = hasRipgrep(tools.env)
        ? ["rg", "-n", "--no-heading", "--hidden", "--glob", "!.git", "-e", pattern, "."]
        : ["grep", "-rnE", "--exclude-dir=.git", "-e", pattern, "."]
      // exit 1 is "no match", not a failure
      return processTool(
        inDirAsOwner(root.path, argv),
        tools.repoDir,
        FILE_TOOL_TIMEOUT,
        (code) => code === 0 || code === 1
      )
    }
  })
}
