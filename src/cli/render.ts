import * as Args from "@effect/cli/Args"
import * as HelpDoc from "@effect/cli/HelpDoc"
import * as ValidationError from "@effect/cli/ValidationError"
import * as Cause from "effect/Cause"
import * as Console from "effect/Console"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as FiberRef from "effect/FiberRef"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import { readEnv, skipScrub } from "../lib/env.js"
import { escapeControl } from "../lib/text.js"
import { SecretScrubber } from "../services/SecretScrubber.js"
import { exitCodeFor, UNKNOWN_ERROR_EXIT } from "./exitCodes.js"

/** `abox rm` without `--yes` when stdin is not a terminal: nobody can be asked */
export class ConfirmationRequired extends Schema.TaggedError<ConfirmationRequired>()("ConfirmationRequired", {
  message: Schema.String
}) {}

/** the user answered no (or quit the prompt) */
export class Cancelled extends Schema.TaggedError<Cancelled>()("Cancelled", {
  message: Schema.String
}) {}

/** a bad command line found by a command itself (after @effect/cli parsed it): exit 64 like its own */
export class UsageError extends Schema.TaggedError<UsageError>()("ValidationError", {
  message: Schema.String
}) {}

/** An error already rendered for the user; the runner's teardown turns it into the exit code. */
export class CliExit extends Data.TaggedError("CliExit")<{ readonly code: number; readonly tag: string }> {}

interface Tagged {
  readonly _tag: string
  readonly message?: unknown
}

const isTagged = (u: unknown): u is Tagged =>
  typeof u === "object" && u !== null && "_tag" in u && typeof (u as { _tag: unknown })._tag === "string"

/** fields that never go to the user as such */
const HIDDEN = new Set(["_tag", "message", "stack", "cause", "name", "_op"])

const jsonSafe = (value: unknown): unknown => {
  if (value === null || ["string", "number", "boolean"].includes(typeof value)) return value
  if (Array.isArray(value)) return value.map((v) => jsonSafe(v))
  if (typeof value === "object") {
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, jsonSafe(v)]))
  }
  return String(value)
}

export const errorMessage = (error: Tagged): string =>
  typeof error.message === "string" && error.message.length > 0 ? error.message : error._tag

/** `{"error":{"_tag":…,"message":…, ...other fields}}` */
export const errorJson = (error: Tagged): { readonly error: Record<string, unknown> } => {
  const fields: Record<string, unknown> = { _tag: error._tag, message: errorMessage(error) }
  for (const [key, value] of Object.entries(error)) {
    if (!HIDDEN.has(key)) fields[key] = jsonSafe(value)
  }
  return { error: fields }
}

export const printJson = (value: unknown) => Console.log(JSON.stringify(value, null, 2))

/**
 * one line on stderr, or the JSON error object on stdout, on one line (docs/cli-json.md): it may
 * follow a stream's JSON lines (`run --json`), so it is a JSON line too. The line's names and
 * paths (a session's source, a name, a guest's words) have their control characters escaped.
 */
export const renderError = (error: Tagged, json: boolean) =>
  json
    ? Console.log(JSON.stringify(errorJson(error)))
    : Console.error(`abox: ${escapeControl(errorMessage(error).split("\n").join(" "))}`)

/** DESIGN: the scrubber runs on every start. Nothing secret is printed, only counts. */
export const startupScrub = Effect.gen(function* () {
  if (yield* readEnv(skipScrub)) return
  const scrubber = yield* SecretScrubber
  const report = yield* scrubber.scrub({ dryRun: false })
  const changed = report.findings.filter((f) => f.changed)
  if (changed.length > 0) {
    yield* Console.error(
      `abox: removed leftover secrets from ${changed.length} file(s) (abox scrub --dry-run shows where)`
    )
  }
  if (report.problems.length > 0) {
    yield* Console.error(
      `abox: the secret scrub could not check ${report.problems.length} file(s) (abox scrub --json)`
    )
  }
})

/**
 * The edge of every command: the start-up scrub (unless `scrub: false`), then the body; a
 * failure is rendered once (human line or JSON) and becomes `CliExit` with the tag's code.
 */
export const edge =
  (options: { readonly json: boolean; readonly scrub?: boolean }) =>
  <A, E extends Tagged, R>(body: Effect.Effect<A, E, R>) =>
    Effect.gen(function* () {
      if (options.scrub !== false) yield* startupScrub
      return yield* body
    }).pipe(
      Effect.catchAll((error) =>
        // a CliExit is an outcome already shown (e.g. `abox run` exiting with the turn's status)
        error instanceof CliExit
          ? Effect.fail(error)
          : renderError(error, options.json).pipe(
              Effect.zipRight(Effect.fail(new CliExit({ code: exitCodeFor(error._tag), tag: error._tag })))
            )
      ),
      (effect) => withCommandConsole(effect)
    )

/** the process's console, kept aside while @effect/cli parses with a quiet one (see `parsedAtTheEdge`) */
const commandConsole = FiberRef.unsafeMake<Option.Option<Console.Console>>(Option.none())

const withCommandConsole = <A, E, R>(body: Effect.Effect<A, E, R>) =>
  Effect.flatMap(FiberRef.get(commandConsole), (saved) =>
    Option.match(saved, { onNone: () => body, onSome: (console) => Effect.withConsole(body, console) })
  )

/**
 * A positional argument that is not an option: @effect/cli hands an unknown `--flag` to the
 * next positional (`run --bogus dir` would look for a directory called `--bogus`).
 */
export const notAnOption = <A extends string>(args: Args.Args<A>): Args.Args<A> =>
  Args.mapEffect(args, (value) =>
    value.startsWith("-") && value !== "-"
      ? Effect.fail(HelpDoc.p(`unknown option ${value}`))
      : Effect.succeed(value)
  )

/** `--json` among the words before `--` (after it they are the turn's) */
export const wantsJson = (argv: ReadonlyArray<string>): boolean => {
  const end = argv.indexOf("--")
  return (end === -1 ? argv : argv.slice(0, end)).includes("--json")
}

const ANSI = /\u001b\[[0-9;]*[A-Za-z]/g

/** @effect/cli's error text as one plain line */
export const validationText = (error: ValidationError.ValidationError): string =>
  HelpDoc.toAnsiText(error.error)
    .replace(ANSI, "")
    .split("\n")
    .map((l) => l.trim())
    .filter((l) => l !== "")
    .join(" ")

/** @effect/cli's type sentences, said of every argument and option: noise in our help */
const HELP_BOILERPLATE =
  /^ {2}(A user-defined piece of text\.|A true or false value\.|An integer\.|A file system path\.|A directory path\.|This argument must be repeated at least \d+ times?\.|This setting is optional\.)\n\n?/gm

/**
 * `--help` as people read it: no colour when stdout is not a terminal or NO_COLOR is set, usage
 * lines that start with `abox`, without @effect/cli's per-type boilerplate.
 */
export const tidyHelp = (text: string): string => {
  const plain = process.stdout.isTTY !== true || (process.env.NO_COLOR ?? "") !== ""
  return (plain ? text.replace(ANSI, "") : text)
    .replace(/^\$ (?!abox\b)/gm, "$ abox ")
    .replace(HELP_BOILERPLATE, "")
}

/**
 * The one error edge for what @effect/cli finds before a command runs (unknown flag, missing or
 * bad argument): instead of its own multi-line printout, the same one line (or `{"error":…}`
 * with `--json`) and exit code 64 as every other error. Its own printing of these goes to a
 * quiet console; each command's edge gets the real one back.
 */
export const parsedAtTheEdge =
  (argv: ReadonlyArray<string>) =>
  <A, E, R>(cli: Effect.Effect<A, E, R>) =>
    Console.consoleWith((console) =>
      cli.pipe(
        Effect.withConsole({
          ...console,
          error: () => Effect.void,
          log: (...args: ReadonlyArray<unknown>) =>
            console.log(...args.map((a) => (typeof a === "string" && a.includes("USAGE") ? tidyHelp(a) : a)))
        }),
        Effect.locally(commandConsole, Option.some(console)),
        Effect.catchIf(
          (e): e is E & ValidationError.ValidationError => ValidationError.isValidationError(e),
          (e) =>
            renderError(
              { _tag: "ValidationError", message: `${validationText(e)} (abox --help shows the usage)` },
              wantsJson(argv)
            ).pipe(
              Effect.zipRight(
                Effect.fail(new CliExit({ code: exitCodeFor("ValidationError"), tag: "ValidationError" }))
              )
            )
        )
      )
    )

/** the exit code of the whole run (the runner's teardown) */
export const exitCodeOf = (exit: Exit.Exit<unknown, unknown>): number => {
  if (Exit.isSuccess(exit)) return 0
  if (Cause.isInterruptedOnly(exit.cause)) return 130
  const failure = Cause.failureOption(exit.cause)
  if (Option.isSome(failure)) {
    const error = failure.value
    if (error instanceof CliExit) return error.code
    if (ValidationError.isValidationError(error)) return exitCodeFor("ValidationError")
    if (isTagged(error)) return exitCodeFor(error._tag)
  }
  return UNKNOWN_ERROR_EXIT
}

/** print what nobody rendered yet: defects and untagged failures (CliExit and ValidationError are already shown) */
export const reportUnexpected = (exit: Exit.Exit<unknown, unknown>): string | undefined => {
  if (Exit.isSuccess(exit) || Cause.isInterruptedOnly(exit.cause)) return undefined
  const failure = Cause.failureOption(exit.cause)
  if (Option.isSome(failure) && ValidationError.isValidationError(failure.value)) return undefined
  if (Option.isSome(failure) && isTagged(failure.value)) {
    if (failure.value._tag === "CliExit" || exitCodeFor(failure.value._tag) !== UNKNOWN_ERROR_EXIT)
      return undefined
  }
  return Cause.pretty(exit.cause)
}
