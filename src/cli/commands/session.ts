import * as Args from "@effect/cli/Args"
import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"
import {
  open,
  resume,
  type BootOptions,
  type Phase,
  type Session,
  type TurnMode
} from "../../programs/session.js"
import type { TurnEvent } from "../../services/GuestRpc.js"
import { HttpsBroker } from "../../services/HttpsBroker.js"
import { CliExit, edge } from "../render.js"
import { interactive } from "../interactive.js"
import { progressBar } from "../progress.js"
import { jsonEvent, printEvent, turnExitCode } from "../turnOutput.js"
import { json } from "./list.js"
import { sessionRef } from "./show.js"
import { startSession } from "./detached.js"
import { agentPreset } from "../../lib/agentPresets.js"

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
  Options.withDescription("golden image: name or name@digest (default: the default image)")
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
const policy = Options.file("policy", { exists: "yes" }).pipe(
  Options.optional,
  Options.withDescription(
    "HTTPS broker policy file (docs/broker.md); default: the session's, else $ABOX_HOME/broker.json, else deny all"
  )
)
const source = Args.directory({ name: "dir", exists: "yes" }).pipe(
  Args.withDescription("the repository to copy into the session")
)
const turnWords = Args.text({ name: "turn" }).pipe(Args.repeated, Args.withDescription("the turn, after --"))
const prompt = Options.text("prompt").pipe(
  Options.withAlias("p"),
  Options.optional,
  Options.withDescription("one turn for the model agent (instead of a shell command after --)")
)

/** a usage error found in a handler (not by the parser): rendered and exits 64 like the parser's */
class TurnUsageError extends Schema.TaggedError<TurnUsageError>()("ValidationError", {
  message: Schema.String
}) {}

/** `--prompt` or the words after `--`, never both */
const turnOf = (args: { readonly prompt: Option.Option<string>; readonly turn: ReadonlyArray<string> }) =>
  Option.isSome(args.prompt)
    ? args.turn.length > 0
      ? Effect.fail(
          new TurnUsageError({ message: "give either --prompt or a shell command after --, not both" })
        )
      : Effect.succeed({ text: args.prompt.value, mode: "prompt" as const })
    : Effect.succeed({ text: args.turn.join(" "), mode: "shell" as const })

export const bootOptions = (args: {
  readonly model: Option.Option<string>
  readonly cpus: Option.Option<number>
  readonly memory: Option.Option<number>
  readonly agent: ReadonlyArray<string>
  readonly policy: Option.Option<string>
}) =>
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
      policy
    } satisfies BootOptions
  })

/** The step display: each phase of Open/Resume with the time it took, on stderr. */
const stepDisplay = (enabled: boolean) => {
  let current: { readonly phase: Phase; readonly started: number } | undefined
  const finish = () => {
    if (current !== undefined && enabled) {
      process.stderr.write(
        `  ${current.phase.padEnd(9)} ${((Date.now() - current.started) / 1000).toFixed(2)}s\n`
      )
    }
  }
  return (next: Phase) =>
    Effect.sync(() => {
      finish()
      current = next === "ready" ? undefined : { phase: next, started: Date.now() }
    })
}

const writeJsonLine = (value: unknown) =>
  Effect.sync(() => process.stdout.write(JSON.stringify(value) + "\n"))

/** One turn to the terminal: output as it comes; the end's exit status is returned. */
export const printTurn = (session: Session, text: string, asJson: boolean, mode: TurnMode = "shell") =>
  session
    .turn(text, mode)
    .pipe(
      Stream.runFoldEffect(undefined as TurnEvent | undefined, (_, event) =>
        Effect.as(asJson ? writeJsonLine({ event: jsonEvent(event) }) : printEvent(event), event)
      )
    )

/** one turn, then Close (the scope); exits with the turn's status */
const oneTurn = (
  session: Session,
  turn: { readonly text: string; readonly mode: TurnMode },
  asJson: boolean
) =>
  Effect.gen(function* () {
    if (asJson) yield* writeJsonLine({ session: session.id, dir: session.dir })
    else yield* Console.error(`abox: session ${session.id}`)
    const end = yield* printTurn(session, turn.text, asJson, turn.mode)
    const code = turnExitCode(end)
    if (code !== 0) return yield* new CliExit({ code, tag: "TurnExit" })
  })

export const run = Command.make(
  "run",
  {
    source,
    name,
    model,
    image,
    cpus,
    memory,
    agent,
    policy,
    keep: Options.boolean("keep").pipe(
      Options.withDescription(
        "print how to resume the session afterwards (the session stays on disk either way)"
      )
    ),
    json,
    prompt,
    turn: turnWords
  },
  (args) =>
    edge({ json: args.json })(
      Effect.scoped(
        Effect.gen(function* () {
          const turn = yield* turnOf(args)
          const session = yield* open({
            ...(yield* bootOptions(args)),
            source: args.source,
            name: Option.getOrUndefined(args.name),
            image: Option.getOrUndefined(args.image),
            onPhase: stepDisplay(!args.json && process.stderr.isTTY === true),
            onProgress: progressBar(!args.json && process.stderr.isTTY === true)
          })
          yield* oneTurn(session, turn, args.json)
          if (args.keep && !args.json) yield* Console.error(`abox: resume with: abox resume ${session.id}`)
        })
      )
    )
).pipe(
  Command.withDescription(
    "open a session on <dir>, run one turn (a shell command after --, or --prompt for the model agent), close; exits with the turn's status"
  )
)

export const openCommand = Command.make(
  "open",
  {
    source,
    name,
    model,
    image,
    cpus,
    memory,
    agent,
    policy,
    detach: Options.boolean("detach").pipe(
      Options.withDescription("start the session in the background instead (as abox start; docs/detached.md)")
    )
  },
  (args) =>
    args.detach
      ? edge({ json: false })(startSession(args.source, { ...args, idleTimeout: Option.none(), json: false }))
      : edge({ json: false })(
          Effect.scoped(
            Effect.gen(function* () {
              const session = yield* open({
                ...(yield* bootOptions(args)),
                source: args.source,
                name: Option.getOrUndefined(args.name),
                image: Option.getOrUndefined(args.image),
                onPhase: stepDisplay(true),
                onProgress: progressBar(true)
              })
              for (const skipped of session.skipped)
                yield* Console.error(`abox: skipped ${skipped} (not a file, directory or link)`)
              // with --agent, a line is a turn for that command (as before); else a prompt
              yield* interactive(session, { lines: args.agent.length > 0 ? "shell" : "prompt" })
            })
          )
        )
).pipe(
  Command.withDescription(
    "open a session on <dir> and talk to its agent (Ctrl-C cancels a turn, Ctrl-D or /exit closes)"
  )
)

export const resumeCommand = Command.make(
  "resume",
  { ref: sessionRef, model, cpus, memory, agent, policy, json, prompt, turn: turnWords },
  (args) =>
    edge({ json: args.json })(
      Effect.scoped(
        Effect.gen(function* () {
          const turn = yield* turnOf(args)
          const interactiveMode = args.turn.length === 0 && Option.isNone(args.prompt)
          const session = yield* resume(args.ref, {
            ...(yield* bootOptions(args)),
            onPhase: stepDisplay(interactiveMode || (!args.json && process.stderr.isTTY === true))
          })
          if (interactiveMode)
            yield* interactive(session, { lines: args.agent.length > 0 ? "shell" : "prompt" })
          else yield* oneTurn(session, turn, args.json)
        })
      )
    )
).pipe(
  Command.withDescription("boot an existing session again: interactive, or one turn (after --, or --prompt)")
)
