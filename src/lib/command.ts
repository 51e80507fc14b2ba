/**
 * A host tool run to its end through @effect/platform's `Command` (git, mkfs.ext4, debugfs,
 * a version probe, the KVM probe): the process is a scoped resource, so an interrupted or
 * timed-out run kills it (its whole process group) and waits for it.
 */
import * as Command from "@effect/platform/Command"
import type * as CommandExecutor from "@effect/platform/CommandExecutor"
import type { PlatformError } from "@effect/platform/Error"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"

/** the tool could not be started (not installed, not executable) or its pipes failed */
export class CommandNotRun extends Data.TaggedError("CommandNotRun")<{
  readonly command: string
  readonly cause: PlatformError
}> {}

/** the tool wrote more to stdout than the caller takes: it was killed */
export class CommandOutputTooLarge extends Data.TaggedError("CommandOutputTooLarge")<{
  readonly command: string
  readonly limit: number
}> {}

export interface CommandResult {
  readonly exitCode: number
  readonly stdout: Buffer
  /** the first STDERR_KEPT characters of its stderr */
  readonly stderr: string
}

/** how much of a tool's stderr is kept for its error message */
export const STDERR_KEPT = 16384

/**
 * Runs `command` to its end (its environment exactly `env`: nothing of abox's own is inherited),
 * with `input` on its stdin (an empty stdin when absent), and collects its stdout (at most
 * `maxOutput` bytes: beyond, the tool is killed) and the start of its stderr. A non-zero exit is
 * a result, not an error: each caller says what it means.
 */
export const runCommand = (
  command: string,
  args: ReadonlyArray<string>,
  options: {
    readonly env: Record<string, string>
    readonly cwd?: string | undefined
    readonly input?: Uint8Array | string | undefined
    readonly maxOutput?: number | undefined
  }
): Effect.Effect<CommandResult, CommandNotRun | CommandOutputTooLarge, CommandExecutor.CommandExecutor> => {
  let made = Command.make(command, ...args).pipe(Command.env(options.env, { extendEnv: false }))
  if (options.cwd !== undefined) made = Command.workingDirectory(made, options.cwd)
  const input = options.input ?? ""
  made = Command.stdin(made, Stream.make(typeof input === "string" ? new TextEncoder().encode(input) : input))
  const notRun = (cause: PlatformError) => new CommandNotRun({ command, cause })
  return Effect.scoped(
    Effect.gen(function* () {
      const child = yield* Command.start(made).pipe(Effect.mapError(notRun))
      const out: Array<Uint8Array> = []
      let size = 0
      const stdout = Stream.runForEach(child.stdout, (chunk) => {
        size += chunk.length
        if (options.maxOutput !== undefined && size > options.maxOutput) {
          out.length = 0
          return Effect.fail(new CommandOutputTooLarge({ command, limit: options.maxOutput }))
        }
        out.push(chunk)
        return Effect.void
      }).pipe(Effect.mapError((error) => (error._tag === "CommandOutputTooLarge" ? error : notRun(error))))
      let stderr = ""
      const decoder = new TextDecoder()
      const errors = Stream.runForEach(child.stderr, (chunk) =>
        Effect.sync(() => {
          if (stderr.length < STDERR_KEPT) stderr += decoder.decode(chunk, { stream: true })
        })
      ).pipe(Effect.mapError(notRun))
      // a failure (output too large) ends the scope, which kills the tool
      const [, , exitCode] = yield* Effect.all(
        [stdout, errors, child.exitCode.pipe(Effect.mapError(notRun))],
        {
          concurrency: "unbounded"
        }
      )
      return { exitCode, stdout: Buffer.concat(out), stderr: stderr.slice(0, STDERR_KEPT) }
    })
  )
}
