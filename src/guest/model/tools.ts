/**
 * The model agent's tools (docs/protocol.md "Agent events"), each run as the unprivileged
 * repository owner in the repository, with a timeout, an output cap (head and tail kept, the
 * cut said) and cancellation that kills the process group:
 *
 * - `shell`: `/bin/sh -c <command>` (git is used through it). Not named `bash`: @effect/ai-anthropic
 *   takes a tool of that name for Anthropic's provider-defined bash tool.
 * - `read_file` (numbered lines, a range of them), `write_file`, `edit_file` (an exact replacement
 *   that must match once, or every match with `replace_all`; only of a file read in this
 *   conversation): file operations done with the agent's effective uid/gid switched to the owner's for
 *   the duration of one synchronous call, so the kernel checks them as the owner's own.
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
import type { TurnUser } from "../user.js"
import { errorMessage } from "../../domain/errorMessage.js"
import { DEFAULT_READ_LINES, numberedLines, ReadLedger, replaceText } from "./fileText.js"

/** characters of tool output the model sees at most (half head, half tail) */
export const DEFAULT_OUTPUT_CAP = 30_000
export const DEFAULT_SHELL_TIMEOUT_S = 120
export const MAX_SHELL_TIMEOUT_S = 1800
const FILE_TOOL_TIMEOUT = Duration.seconds(30)
const READ_FILE_MAX_BYTES = 4 * 1024 * 1024

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
}

/** signal a whole process group; ESRCH (already gone) is not an error */
const killGroup = (pid: number | undefined, signal: NodeJS.Signals): void => {
  if (pid === undefined) return
  try {
    process.kill(-pid, signal)
  } catch {
    // the group is gone
  }
}

/** process groups of running tools, for a synchronous last-resort kill (SIGTERM to the agent) */
const liveGroups = new Set<number>()
export const killAllTools = (): void => {
  for (const pid of liveGroups) killGroup(pid, "SIGKILL")
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

/**
 * One synchronous file operation with the effective uid/gid (and groups) of the owner, so the
 * kernel checks it as theirs; back to root before anything else runs. No-op when not root.
 */
export const asOwner = <A>(
  user: TurnUser | undefined,
  repoDir: string,
  absolute: string,
  operation: (file: string) => A
): A => {
  if (user === undefined || typeof process.seteuid !== "function") return operation(absolute)
  // the path is taken from the repository down (as the owner's own processes, whose working
  // directory is the repository, see it): the directories above it are not the owner's business
  const cwd = process.cwd()
  process.chdir(repoDir)
  const groups = process.getgroups!()
  process.setgroups!([user.gid])
  process.setegid!(user.gid)
  process.seteuid(user.uid)
  try {
    return operation(path.relative(repoDir, absolute) || ".")
  } finally {
    process.seteuid(0)
    process.setegid!(0)
    process.setgroups!(groups)
    process.chdir(cwd)
  }
}

const hasRipgrep = (env: Readonly<Record<string, string>>): boolean =>
  (env["PATH"] ?? "").split(":").some((dir) => dir !== "" && fs.existsSync(path.join(dir, "rg")))

/** the toolkit's handlers over one environment; every result carries its time */
export const makeHandlers = (tools: ToolEnvironment) => {
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
  const inRepo = (
    requested: string,
    operation: (file: string, absolute: string) => Omit<ToolOutput, "durationMs">
  ): Effect.Effect<ToolOutput> =>
    timed(
      Effect.sync(() => {
        const resolved = resolveRepoPath(tools.repoDir, requested)
        if (!resolved.ok) return fail(`refused: ${resolved.reason}`)
        try {
          return asOwner(tools.user, tools.repoDir, resolved.path, (file) => operation(file, resolved.path))
        } catch (error) {
          return fail(errorMessage(error))
        }
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
      inRepo(requested, (file, absolute) => {
        const fd = fs.openSync(file, fs.constants.O_RDONLY | fs.constants.O_NOFOLLOW)
        try {
          const buffer = Buffer.alloc(READ_FILE_MAX_BYTES + 1)
          const read = fs.readSync(fd, buffer, 0, buffer.length, 0)
          const text = buffer.subarray(0, Math.min(read, READ_FILE_MAX_BYTES)).toString("utf8")
          const lines = numberedLines(text, offset, limit)
          if (!lines.ok) return fail(`${requested}: ${lines.reason}`)
          ledger.add(absolute)
          const note =
            read > READ_FILE_MAX_BYTES
              ? `\n[file larger than ${READ_FILE_MAX_BYTES} bytes; the rest was not read]`
              : ""
          return ok(lines.text + note)
        } finally {
          fs.closeSync(fd)
        }
      }),
    write_file: ({ path: requested, content }) =>
      inRepo(requested, (file, absolute) => {
        fs.mkdirSync(path.dirname(file), { recursive: true })
        fs.writeFileSync(file, content, { flag: "w" })
        // the model knows what it wrote: an edit of it needs no read first
        ledger.add(absolute)
        return ok(`wrote ${Buffer.byteLength(content)} bytes to ${requested}`)
      }),
    edit_file: ({ path: requested, old_string, new_string, replace_all }) =>
      inRepo(requested, (file, absolute) => {
        if (!ledger.has(absolute)) {
          return fail(`refused: read ${requested} with read_file before editing it`)
        }
        const edited = replaceText(
          fs.readFileSync(file, "utf8"),
          old_string,
          new_string,
          replace_all === true
        )
        if (!edited.ok) return fail(`${requested}: ${edited.reason}`)
        fs.writeFileSync(file, edited.text)
        return ok(`edited ${requested}${edited.count === 1 ? "" : ` (${edited.count} occurrences replaced)`}`)
      }),
    list_files: ({ path: requested }) => {
      const root = searchRoot(requested)
      if (!root.ok) return timed(Effect.succeed(fail(`refused: ${root.reason}`)))
      const argv = hasRipgrep(tools.env)
        ? ["rg", "--files", "--hidden", "--glob", "!.git", "."]
        : ["find", ".", "-path", "./.git", "-prune", "-o", "-type", "f", "-print"]
      return processTool(argv, root.path, FILE_TOOL_TIMEOUT)
    },
    search: ({ pattern, path: requested }) => {
      const root = searchRoot(requested)
      if (!root.ok) return timed(Effect.succeed(fail(`refused: ${root.reason}`)))
      const argv = hasRipgrep(tools.env)
        ? ["rg", "-n", "--no-heading", "--hidden", "--glob", "!.git", "-e", pattern, "."]
        : ["grep", "-rnE", "--exclude-dir=.git", "-e", pattern, "."]
      // exit 1 is "no match", not a failure
      return processTool(argv, root.path, FILE_TOOL_TIMEOUT, (code) => code === 0 || code === 1)
    }
  })
}
