import * as Args from "@effect/cli/Args"
import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Ref from "effect/Ref"
import * as Stream from "effect/Stream"
import { openWithEnvironment } from "../../programs/environment.js"
import { allowEnvHosts, environmentOptions } from "../environmentOptions.js"
import {
  InvalidOption,
  resume,
  turnLimitsProblem,
  type BootOptions,
  type OpenOptions,
  type Session,
  type TurnMode
} from "../../programs/session.js"
import type { TurnLimits } from "../../protocol/Messages.js"
import type { TurnEvent } from "../../services/GuestRpc.js"
import { HttpsBroker } from "../../services/HttpsBroker.js"
import { remove } from "../../programs/remove.js"
import { CliExit, edge, notAnOption, UsageError } from "../render.js"
import { interactive } from "../interactive.js"
import { progressBar, stepDisplay } from "../progress.js"
import { holdingSession } from "../runMain.js"
import { jsonEvent, printEvent, turnExitCode, writeOutput } from "../turnOutput.js"
import { json } from "./list.js"
import { sessionRef } from "./show.js"
import { startSession } from "./detached.js"
import { agentPreset } from "../../lib/agentPresets.js"
import { escapeControl } from "../../lib/text.js"

const name = Options.text("name").pipe(
  Options.optional,
  Options.withDescription("bind the session to this name")
)
const model = Options.text("model").pipe(
  Options.optional,
  Options.withDescription("model alias passed to the agent")
)
const image = Options.text("image").pipe(
  Options.optional,
  Options.withDescription(
    "golden image: name or name@digest (default: the repository's environment, else the default image)"
  )
)
const cpus = Options.integer("cpus").pipe(Options.optional, Options.withDescription("guest CPUs (default 2)"))
const memory = Options.integer("memory").pipe(
  Options.optional,
  Options.withDescription("guest memory in MiB (default 1024)")
)
const agent = Options.text("agent").pipe(
  Options.repeated,
  Options.withDescription(
    "agent command argv (repeat per word), or a preset: claude, codex; default: each turn runs as a shell command"
  )
)
// existence is checked by the program (BrokerPolicyError, SourceInvalid), not the parser
const policy = Options.file("policy").pipe(
  Options.optional,
  Options.withDescription(
    "HTTPS broker policy file (docs/broker.md); default: the session's, else $ABOX_HOME/broker.json, else deny all"
  )
)
const source = notAnOption(Args.directory({ name: "dir" })).pipe(
  Args.withDescription("the repository to copy into the session")
)
const turnWords = Args.text({ name: "turn" }).pipe(Args.repeated, Args.withDescription("the turn, after --"))
const prompt = Options.text("prompt").pipe(
  Options.withAlias("p"),
  Options.optional,
  Options.withDescription("one turn for the model agent (instead of a shell command after --)")
)

export const maxSteps = Options.integer("max-steps").pipe(
  Options.optional,
  Options.withDescription(
    "with --prompt: end the turn after this many model requests (1-1000; default the session's, 50)"
  )
)
export const maxCost = Options.float("max-cost").pipe(
  Options.optional,
  Options.withDescription(
    "with --prompt: end the turn once it has cost this many US dollars (from the usage and the model catalog's prices)"
  )
)

/** `--max-steps` / `--max-cost` as a prompt turn's limits; the flags' own mistakes are usage errors */
export const turnLimitsOf = (args: {
  readonly maxSteps: Option.Option<number>
  readonly maxCost: Option.Option<number>
  readonly prompt: Option.Option<string>
}): Effect.Effect<TurnLimits | undefined, UsageError> => {
  if (Option.isNone(args.maxSteps) && Option.isNone(args.maxCost)) return Effect.succeed(undefined)
  if (Option.isNone(args.prompt))
    return Effect.fail(new UsageError({ message: "--max-steps and --max-cost are for a --prompt turn" }))
  if (Option.isSome(args.maxSteps) && !(args.maxSteps.value >= 1 && args.maxSteps.value <= 1000))
    return Effect.fail(new UsageError({ message: "--max-steps must be from 1 to 1000" }))
  if (Option.isSome(args.maxCost) && !(args.maxCost.value > 0 && Number.isFinite(args.maxCost.value)))
    return Effect.fail(new UsageError({ message: "--max-cost must be a positive number of US dollars" }))
  return Effect.succeed({
    ...(Option.isSome(args.maxSteps) ? { maxSteps: args.maxSteps.value } : {}),
    ...(Option.isSome(args.maxCost) ? { maxCostUsd: args.maxCost.value } : {})
  })
}

/** `--prompt` or the words after `--`, never both */
const turnOf = (args: { readonly prompt: Option.Option<string>; readonly turn: ReadonlyArray<string> }) =>
  Option.isSome(args.prompt)
    ? args.turn.length > 0
      ? Effect.fail(new UsageError({ message: "give either --prompt or a shell command after --, not both" }))
      : Effect.succeed({ text: args.prompt.value, mode: "prompt" as const })
    : Effect.succeed({ text: args.turn.join(" "), mode: "shell" as const })

interface BootArgs {
  readonly model: Option.Option<string>
  readonly cpus: Option.Option<number>
  readonly memory: Option.Option<number>
  readonly agent: ReadonlyArray<string>
  readonly policy: Option.Option<string>
}

/** the flags open, run and resume share, applied in this one place */
export const bootOptions = (args: BootArgs, onPhase?: BootOptions["onPhase"]) =>
  Effect.gen(function* () {
    const broker = yield* HttpsBroker
    const policy = Option.isSome(args.policy) ? yield* broker.loadPolicy(args.policy.value) : undefined
    // `--agent claude` / `--agent codex`: the CLI's headless argv, and a model of its provider
    const preset = agentPreset(args.agent)
    return {
      model: Option.getOrUndefined(args.model) ?? preset?.defaultModel,
      cpus: Option.getOrUndefined(args.cpus),
      memoryMiB: Option.getOrUndefined(args.memory),
      agent: preset !== undefined ? preset.argv : args.agent.length > 0 ? args.agent : undefined,
      policy,
      onPhase
    } satisfies BootOptions
  })

/** Open from the flags `run` and `open` share */
const openFromArgs = (
  args: BootArgs & {
    readonly source: string
    readonly name: Option.Option<string>
    readonly image: Option.Option<string>
    readonly allowEnvHosts: boolean
  },
  onPhase: BootOptions["onPhase"],
  onProgress: BootOptions["onProgress"]
) =>
  Effect.gen(function* () {
    const options: OpenOptions = {
      ...(yield* bootOptions(args, onPhase)),
      onProgress,
      source: args.source,
      name: Option.getOrUndefined(args.name),
      image: Option.getOrUndefined(args.image)
    }
    // the repository's environment (docs/environments.md), unless --image names one
    return yield* openWithEnvironment({ ...options, ...(yield* environmentOptions(args.allowEnvHosts)) })
  })

const writeJsonLine = (value: unknown) => writeOutput(process.stdout, JSON.stringify(value) + "\n")

/** One turn to the terminal: output as it comes; the end's exit status is returned. */
export const printTurn = (
  session: Session,
  text: string,
  asJson: boolean,
  mode: TurnMode = "shell",
  limits?: TurnLimits
) =>
  session
    .turn(text, mode, limits)
    .pipe(
      Stream.runFoldEffect(undefined as TurnEvent | undefined, (_, event) =>
        Effect.as(asJson ? writeJsonLine({ event: jsonEvent(event) }) : printEvent(event), event)
      )
    )

/** one turn, then Close (the scope); exits with the turn's status */
const oneTurn = (
  session: Session,
  turn: { readonly text: string; readonly mode: TurnMode },
  asJson: boolean,
  limits?: TurnLimits
) =>
  Effect.gen(function* () {
    if (asJson) yield* writeJsonLine({ session: session.id, dir: session.dir })
    else yield* Console.error(`abox: session ${escapeControl(session.id)}`)
    // limits this session cannot honour (an older guest, a model without prices): refused before the turn
    const problem = turnLimitsProblem(session.hello, session.modelSpec, turn.mode, limits)
    if (problem !== undefined) return yield* new InvalidOption(problem)
    const end = yield* printTurn(session, turn.text, asJson, turn.mode, limits)
    const code = turnExitCode(end)
    if (code !== 0) return yield* new CliExit({ code, tag: "TurnExit" })
  })

/** what open and run both take: the source, its name and image, and the boot flags */
const openFlags = { source, name, model, image, cpus, memory, agent, policy, allowEnvHosts }

export const run = Command.make(
  "run",
  {
    ...openFlags,
    keep: Options.boolean("keep").pipe(
      Options.withDescription("keep the session on disk afterwards (the default; the opposite of --rm)")
    ),
    rm: Options.boolean("rm").pipe(
      Options.withDescription(
        "remove the session after it closes (as abox rm would), whatever the turn's status"
      )
    ),
    json,
    prompt,
    maxSteps,
    maxCost,
    turn: turnWords
  },
  (args) =>
    edge({ json: args.json })(
      Effect.gen(function* () {
        const limits = yield* turnLimitsOf(args)
        if (args.turn.length === 0 && Option.isNone(args.prompt)) {
          return yield* new UsageError({
            message:
              "run needs a turn: abox run <dir> -- <command>, or --prompt '…' for the model agent (abox open <dir> gives a prompt)"
          })
        }
        const turn = yield* turnOf(args)
        if (args.rm && args.keep)
          return yield* new UsageError({ message: "--rm and --keep contradict each other" })
        const opened = yield* Ref.make<Session | undefined>(undefined)
        // after Close (the scope), so the session's lock is free again; also after a failed turn or a signal
        const afterClose = Ref.get(opened).pipe(
          Effect.flatMap((session) => {
            if (session === undefined) return Effect.void
            if (args.rm) {
              return remove([session.id]).pipe(
                Effect.catchAll((error) => Console.error(`abox: --rm: ${escapeControl(error.message)}`))
              )
            }
            return args.json
              ? Effect.void
              : Console.error(
                  escapeControl(
                    `abox: session ${session.id} stays on disk: abox resume ${session.id} · abox rm ${session.id} (run --rm removes it after the turn)`
                  )
                )
          })
        )
        yield* holdingSession(
          Effect.scoped(
            Effect.gen(function* () {
              const session = yield* openFromArgs(
                args,
                yield* stepDisplay(!args.json && process.stderr.isTTY === true),
                progressBar(!args.json && process.stderr.isTTY === true)
              )
              yield* Ref.set(opened, session)
              yield* oneTurn(session, turn, args.json, limits)
            })
          )
        ).pipe(Effect.ensuring(afterClose))
      })
    )
).pipe(
  Command.withDescription(
    "open a session on <dir>, run one turn (a shell command after --, or --prompt for the model agent), close; exits with the turn's status (the session stays unless --rm). Example: abox run --rm ./my-repo -- make test"
  )
)

export const openCommand = Command.make(
  "open",
  {
    ...openFlags,
    detach: Options.boolean("detach").pipe(
      Options.withDescription("start the session in the background instead (as abox start; docs/detached.md)")
    )
  },
  (args) =>
    args.detach
      ? edge({ json: false })(startSession(args.source, { ...args, idleTimeout: Option.none(), json: false }))
      : edge({ json: false })(
          holdingSession(
            Effect.scoped(
              Effect.gen(function* () {
                const session = yield* openFromArgs(args, yield* stepDisplay(true), progressBar(true))
                for (const skipped of session.skipped)
                  yield* Console.error(
                    `abox: skipped ${escapeControl(skipped)} (not a file, directory or link)`
                  )
                // with --agent, a line is a turn for that command (as before); else a prompt
                yield* interactive(session, { lines: args.agent.length > 0 ? "shell" : "prompt" })
              })
            )
          )
        )
).pipe(
  Command.withDescription(
    "open a session on <dir> and talk to its agent (Ctrl-C cancels a turn, Ctrl-D or /exit closes). Example: abox open ./my-repo --name proj"
  )
)

export const resumeCommand = Command.make(
  "resume",
  { ref: sessionRef, model, cpus, memory, agent, policy, json, prompt, maxSteps, maxCost, turn: turnWords },
  (args) =>
    edge({ json: args.json })(
      holdingSession(
        Effect.scoped(
          Effect.gen(function* () {
            const turn = yield* turnOf(args)
            const limits = yield* turnLimitsOf(args)
            const interactiveMode = args.turn.length === 0 && Option.isNone(args.prompt)
            const session = yield* resume(
              args.ref,
              yield* bootOptions(
                args,
                yield* stepDisplay(interactiveMode || (!args.json && process.stderr.isTTY === true))
              )
            )
            if (interactiveMode)
              yield* interactive(session, { lines: args.agent.length > 0 ? "shell" : "prompt" })
            else yield* oneTurn(session, turn, args.json, limits)
          })
        )
      )
    )
).pipe(
  Command.withDescription(
    "boot an existing session again: interactive, or one turn (after --, or --prompt). Example: abox resume proj -- git status"
  )
)
