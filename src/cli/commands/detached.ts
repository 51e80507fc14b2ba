import * as Args from "@effect/cli/Args"
import * as Command from "@effect/cli/Command"
import * as HelpDoc from "@effect/cli/HelpDoc"
import * as Options from "@effect/cli/Options"
import * as ValidationError from "@effect/cli/ValidationError"
import * as Console from "effect/Console"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"
import * as SubscriptionRef from "effect/SubscriptionRef"
import * as fs from "node:fs"
import * as path from "node:path"
import * as readline from "node:readline"
import { ControlError, encodeReadyLine, errorFields, type ControlReply } from "../../protocol/Control.js"
import {
  connect,
  decodeSpec,
  forward,
  READY_FD,
  remoteError,
  startDetached,
  stop,
  type SuperviseSpec
} from "../../programs/detached.js"
import { resume, type Session } from "../../programs/session.js"
import { openWithEnvironment } from "../../programs/environment.js"
import { allowEnvHosts } from "../environmentOptions.js"
import { readEnvironment } from "../../lib/environment.js"
import { agentTurnEvent } from "../../services/GuestRpc.js"
import { supervise } from "../../programs/supervisor.js"
import { parseLine } from "../interactive.js"
import { CliExit, edge, printJson } from "../render.js"
import { jsonEvent, printEvent, turnExitCode } from "../turnOutput.js"
import { json } from "./list.js"
import { bootOptions, maxCost, maxSteps, turnLimitsOf } from "./session.js"
import { sessionRef } from "./show.js"
import { escapeControl } from "../../lib/text.js"

/** `250ms`, `30s`, `5m`, `2h`, or a number of seconds */
export const parseDuration = (text: string): Option.Option<Duration.Duration> => {
  const match = /^(\d+(?:\.\d+)?)(ms|s|m|h)?$/.exec(text.trim())
  if (match === null) return Option.none()
  const value = Number(match[1])
  const unit = match[2] ?? "s"
  const ms =
    unit === "ms" ? value : unit === "s" ? value * 1000 : unit === "m" ? value * 60_000 : value * 3_600_000
  return ms > 0 ? Option.some(Duration.millis(Math.round(ms))) : Option.none()
}

const durationOption = (name: string, description: string) =>
  Options.text(name).pipe(
    Options.mapEffect((text) =>
      Option.match(parseDuration(text), {
        onNone: () =>
          Effect.fail(
            ValidationError.invalidValue(HelpDoc.p(`--${name}: not a duration (30s, 5m, 2h): ${text}`))
          ),
        onSome: Effect.succeed
      })
    ),
    Options.optional,
    Options.withDescription(description)
  )

// ---- supervise (internal: what `start` runs in the background) ----

/** one line on the ready pipe, when this process was started by `abox start` (fd 3 is a pipe) */
const tellStarter = (line: string) =>
  Effect.sync(() => {
    try {
      if (!fs.fstatSync(READY_FD).isFIFO() && !fs.fstatSync(READY_FD).isSocket()) return
      fs.writeSync(READY_FD, line + "\n")
      fs.closeSync(READY_FD)
    } catch {
      // not started with a ready pipe, or the starter went away
    }
  })

type Opened = ReturnType<typeof openWithEnvironment> | ReturnType<typeof resume>
type Acquire = Effect.Effect<Session, Effect.Effect.Error<Opened>, Effect.Effect.Context<Opened>>

const optionOf = <A>(value: A | undefined) => Option.fromNullable(value)

export const superviseCommand = Command.make(
  "supervise",
  {
    spec: Options.text("spec").pipe(
      Options.withDescription("what to supervise (JSON, written by abox start)")
    )
  },
  (args) =>
    edge({ json: false, scrub: false })(
      Effect.gen(function* () {
        const spec = yield* decodeSpec(args.spec).pipe(
          Effect.mapError(
            (error) => new ControlError({ reason: "bad spec", message: `supervise --spec: ${error.message}` })
          )
        )
        const boot = yield* bootOptions({
          model: optionOf(spec.model),
          cpus: optionOf(spec.cpus),
          memory: optionOf(spec.memoryMiB),
          agent: spec.agent ?? [],
          policy: optionOf(spec.policyFile)
        })
        const source = spec.open
        const acquire: Acquire =
          source !== undefined
            ? openWithEnvironment({
                ...boot,
                source: source.source,
                name: source.name,
                image: source.image,
                // no terminal here: the environment's hosts are granted by the policy or the flag alone
                allowEnvHosts: source.allowEnvHosts,
                onNotice: (line) => Console.error(`abox: ${escapeControl(line)}`)
              })
            : resume(spec.resume ?? "", boot)
        const reason = yield* supervise(acquire, {
          lines: spec.agent !== undefined && spec.agent.length > 0 ? "shell" : "prompt",
          idleTimeout: spec.idleTimeoutMs === undefined ? undefined : Duration.millis(spec.idleTimeoutMs),
          onReady: (ready) =>
            Effect.zipRight(
              Console.error(
                `abox: supervising session ${ready.sessionId} (pid ${process.pid}) on ${ready.socket}`
              ),
              tellStarter(
                encodeReadyLine({
                  type: "ready",
                  sessionId: ready.sessionId,
                  pid: process.pid,
                  socket: ready.socket
                })
              )
            )
        })
        yield* Console.error(`abox: supervisor ${process.pid}: closed (${reason})`)
      }).pipe(
        Effect.tapError((error) =>
          tellStarter(encodeReadyLine({ type: "failed", error: errorFields(error) }))
        )
      )
    )
).pipe(Command.withDescription("(internal) hold a session and serve its control socket; run by abox start"))

// ---- start ----

const startOptions = {
  name: Options.text("name").pipe(
    Options.optional,
    Options.withDescription("bind a new session to this name")
  ),
  model: Options.text("model").pipe(
    Options.optional,
    Options.withDescription("model alias passed to the agent")
  ),
  image: Options.text("image").pipe(
    Options.optional,
    Options.withDescription("golden image of a new session: name or name@digest")
  ),
  cpus: Options.integer("cpus").pipe(Options.optional, Options.withDescription("guest CPUs (default 2)")),
  memory: Options.integer("memory").pipe(
    Options.optional,
    Options.withDescription("guest memory in MiB (default 1024)")
  ),
  agent: Options.text("agent").pipe(
    Options.repeated,
    Options.withDescription(
      "agent command argv (repeat per word); default: each turn runs as a shell command"
    )
  ),
  policy: Options.file("policy", { exists: "yes" }).pipe(
    Options.optional,
    Options.withDescription("HTTPS broker policy file (docs/broker.md)")
  ),
  idleTimeout: durationOption("idle-timeout", "close the session after this long with no client and no turn"),
  allowEnvHosts,
  json
}

type StartArgs = {
  readonly [K in keyof typeof startOptions]: (typeof startOptions)[K] extends Options.Options<infer A>
    ? A
    : never
}

/** a directory that exists opens a new session on it; anything else is a session id or name to resume */
const specFor = (target: string, args: StartArgs): SuperviseSpec => {
  const isDir = fs.existsSync(target) && fs.statSync(target).isDirectory()
  return {
    ...(isDir
      ? {
          open: {
            source: path.resolve(target),
            name: Option.getOrUndefined(args.name),
            image: Option.getOrUndefined(args.image),
            ...(args.allowEnvHosts ? { allowEnvHosts: true } : {})
          }
        }
      : { resume: target }),
    model: Option.getOrUndefined(args.model),
    cpus: Option.getOrUndefined(args.cpus),
    memoryMiB: Option.getOrUndefined(args.memory),
    agent: args.agent.length > 0 ? args.agent : undefined,
    policyFile: Option.getOrUndefined(Option.map(args.policy, (file) => path.resolve(file))),
    idleTimeoutMs: Option.getOrUndefined(
      Option.map(args.idleTimeout, (d) => Math.max(1, Duration.toMillis(d)))
    )
  }
}

/** start a detached session and say how to reach it */
export const startSession = (target: string, args: StartArgs) =>
  Effect.gen(function* () {
    const ready = yield* startDetached(specFor(target, args))
    if (args.json) yield* printJson({ session: ready.sessionId, pid: ready.pid, socket: ready.socket })
    else {
      yield* Console.log(ready.sessionId)
      const ref = Option.getOrElse(args.name, () => ready.sessionId)
      yield* Console.error(
        `abox: session ${ready.sessionId} running (supervisor pid ${ready.pid}); abox exec ${ref} -- <cmd> · abox attach ${ref} · abox stop ${ref}`
      )
      // the ports the repository's environment forwards (docs/environments.md)
      const opened = specFor(target, args).open
      if (opened !== undefined && opened.image === undefined) {
        const environment = yield* readEnvironment(opened.source).pipe(Effect.orElseSucceed(() => undefined))
        for (const port of environment?.forward ?? [])
          yield* Console.error(`abox: the environment serves port ${port}: abox forward ${ref} ${port}`)
      }
    }
  })

export const startCommand = Command.make(
  "start",
  {
    target: Args.text({ name: "dir|id|name" }).pipe(
      Args.withDescription("a directory (open a new session on it) or a session to resume")
    ),
    ...startOptions
  },
  (args) => edge({ json: args.json })(startSession(args.target, args))
).pipe(
  Command.withDescription(
    "start a session in the background (a supervisor holds its VM); prints its id. exec, attach, stop reach it"
  )
)

// ---- exec ----

const envPairs = (pairs: ReadonlyArray<string>) =>
  Effect.forEach(pairs, (pair) => {
    const eq = pair.indexOf("=")
    return eq <= 0
      ? Effect.fail(new ControlError({ reason: "bad request", message: `-e ${pair}: expected NAME=value` }))
      : Effect.succeed([pair.slice(0, eq), pair.slice(eq + 1)] as const)
  }).pipe(Effect.map((entries) => Object.fromEntries(entries)))

/** the exit status of a turn seen over the control socket: the shell's convention; 124 on timeout */
const exitStatus = (end: Extract<ControlReply, { type: "turn_end" }>): number =>
  end.timedOut
    ? 124
    : turnExitCode({ _tag: "End", exitCode: end.exitCode, signal: end.signal, cancelled: end.cancelled })

/** a usage error found in a handler (not by the parser): rendered and exits 64 like the parser's */
class ExecUsageError extends Schema.TaggedError<ExecUsageError>()("ValidationError", {
  message: Schema.String
}) {}

/** `--prompt` (a model-agent turn, no -e/-w) or the command after `--`, never both */
const execTurnOf = (args: {
  readonly prompt: Option.Option<string>
  readonly turn: ReadonlyArray<string>
  readonly env: ReadonlyArray<string>
  readonly workdir: Option.Option<string>
}): Effect.Effect<{ readonly text: string; readonly mode?: "prompt" }, ExecUsageError> => {
  if (Option.isNone(args.prompt)) return Effect.succeed({ text: args.turn.join(" ") })
  if (args.turn.length > 0)
    return Effect.fail(
      new ExecUsageError({ message: "give either --prompt or a command after --, not both" })
    )
  if (args.env.length > 0 || Option.isSome(args.workdir))
    return Effect.fail(new ExecUsageError({ message: "-e and -w are for shell commands, not --prompt" }))
  return Effect.succeed({ text: args.prompt.value, mode: "prompt" as const })
}

/** `exec -t`: the local terminal's size (stdout's, as the output goes there; 24×80 otherwise) and TERM */
const localTty = () => {
  const out = process.stdout
  const rows = out.isTTY === true && out.rows > 0 ? out.rows : 24
  const cols = out.isTTY === true && out.columns > 0 ? out.columns : 80
  const term = process.env.TERM
  return {
    rows: Math.min(rows, 0xffff),
    cols: Math.min(cols, 0xffff),
    ...(term !== undefined && /^[A-Za-z0-9._+-]{1,64}$/.test(term) ? { term } : {})
  }
}

/**
 * `exec -it` with a terminal on stdin: raw mode while the turn runs (^C, ^Z, ^D are bytes for the
 * guest's line discipline), the terminal's previous mode restored when the scope closes (turn
 * end, error, signal)
 */
const rawStdin = Effect.acquireRelease(
  Effect.sync(() => {
    const wasRaw = process.stdin.isRaw
    process.stdin.setRawMode(true)
    return wasRaw
  }),
  (wasRaw) =>
    Effect.sync(() => {
      process.stdin.setRawMode(wasRaw)
      process.stdin.pause()
    })
)

/** the local terminal's bytes as they come (until stdin ends) */
const stdinBytes = Stream.async<Buffer>((emit) => {
  const onData = (chunk: Buffer) => void emit.single(chunk)
  const onEnd = () => void emit.end()
  process.stdin.on("data", onData)
  process.stdin.once("end", onEnd)
  process.stdin.resume()
  return Effect.sync(() => {
    process.stdin.off("data", onData)
    process.stdin.off("end", onEnd)
    process.stdin.pause()
  })
})

/** the local terminal changed size (SIGWINCH, which Node reports as stdout's `resize`) */
const terminalResizes = Stream.async<{ rows: number; cols: number }>((emit) => {
  const onResize = () => {
    const { rows, cols } = localTty()
    void emit.single({ rows, cols })
  }
  process.stdout.on("resize", onResize)
  return Effect.sync(() => void process.stdout.off("resize", onResize))
})

export const execCommand = Command.make(
  "exec",
  {
    ref: sessionRef,
    env: Options.text("env").pipe(
      Options.withAlias("e"),
      Options.repeated,
      Options.withDescription("NAME=value for the command (repeatable)")
    ),
    workdir: Options.text("workdir").pipe(
      Options.withAlias("w"),
      Options.optional,
      Options.withDescription("run in this guest directory (default /work/repo)")
    ),
    timeout: durationOption("timeout", "cancel the command after this long (exit 124)"),
    tty: Options.boolean("tty").pipe(
      Options.withAlias("t"),
      Options.withDescription(
        "run the command on a pseudo-terminal in the guest, of this terminal's size and TERM"
      )
    ),
    interactive: Options.boolean("interactive").pipe(
      Options.withAlias("i"),
      Options.withDescription("with -t: send what is typed here to the command (this terminal in raw mode)")
    ),
    prompt: Options.text("prompt").pipe(
      Options.withAlias("p"),
      Options.optional,
      Options.withDescription("a turn for the model agent (instead of a command after --)")
    ),
    maxSteps,
    maxCost,
    json,
    turn: Args.text({ name: "cmd" }).pipe(Args.repeated, Args.withDescription("the command, after --"))
  },
  (args) =>
    edge({ json: args.json, scrub: false })(
      Effect.scoped(
        Effect.gen(function* () {
          const env = yield* envPairs(args.env)
          const turn = yield* execTurnOf(args)
          const limits = yield* turnLimitsOf(args)
          if (args.tty && turn.mode === "prompt")
            return yield* new ExecUsageError({ message: "-t is for shell commands, not --prompt" })
          if (args.interactive && !args.tty)
            return yield* new ExecUsageError({
              message: "-i needs -t: typed input goes to a command on a pseudo-terminal (exec -it)"
            })
          if (args.interactive && process.stdin.isTTY !== true)
            return yield* new ExecUsageError({
              message: "the input device is not a TTY (exec -it needs a terminal on stdin; drop -t or -i)"
            })
          const tty = args.tty ? localTty() : undefined
          const connection = yield* connect(args.ref)
          yield* connection.send({
            type: "turn",
            ...turn,
            ...(limits === undefined ? {} : { limits }),
            ...(tty !== undefined ? { tty } : {}),
            ...(args.env.length > 0 ? { env } : {}),
            ...(Option.isSome(args.workdir) ? { cwd: args.workdir.value } : {}),
            ...(Option.isSome(args.timeout)
              ? { timeoutMs: Math.max(1, Duration.toMillis(args.timeout.value)) }
              : {})
          })
          let end: Extract<ControlReply, { type: "turn_end" }> | undefined
          // a signal to this client cancels its turn (like Ctrl-C in the interactive mode); a
          // client that dies without a word leaves the turn running (docs/detached.md)
          yield* Effect.addFinalizer(() =>
            end !== undefined
              ? Effect.void
              : connection
                  .send({ type: "cancel" })
                  .pipe(
                    Effect.zipRight(
                      Stream.runDrain(
                        connection.replies.pipe(Stream.takeUntil((reply) => reply.type === "turn_end"))
                      )
                    ),
                    Effect.timeout(Duration.seconds(15)),
                    Effect.ignore
                  )
          )
          if (tty !== undefined) {
            // typed bytes go to the command as they are (raw mode: ^C is the guest's SIGINT, so this
            // client does not cancel on it); the terminal's resizes follow it
            if (args.interactive) {
              yield* rawStdin
              yield* stdinBytes.pipe(
                Stream.runForEach((bytes) =>
                  connection.send({ type: "input", data: bytes.toString("base64") })
                ),
                Effect.ignore,
                Effect.forkScoped
              )
            }
            if (process.stdout.isTTY === true)
              yield* terminalResizes.pipe(
                Stream.runForEach((size) => connection.send({ type: "resize", ...size })),
                Effect.ignore,
                Effect.forkScoped
              )
          }
          yield* connection.replies.pipe(
            Stream.takeUntil((reply) => reply.type === "turn_end" || reply.type === "error"),
            Stream.runForEach((reply) => {
              switch (reply.type) {
                case "event":
                  return args.json
                    ? Console.log(JSON.stringify({ event: jsonEvent(agentTurnEvent(reply.event)) }))
                    : printEvent(agentTurnEvent(reply.event))
                case "turn_end":
                  end = reply
                  return args.json ? Console.log(JSON.stringify({ end: reply })) : Effect.void
                case "error":
                  return Effect.fail(remoteError(reply.error))
                default:
                  return Effect.void
              }
            })
          )
          if (end === undefined)
            return yield* new ControlError({
              reason: "closed",
              message: "the supervisor closed the connection before the turn ended"
            })
          const code = exitStatus(end)
          if (code !== 0) return yield* new CliExit({ code, tag: "TurnExit" })
        })
      )
    )
).pipe(
  Command.withDescription(
    "run a command (after --) or a model-agent turn (--prompt) in a running session (abox start); exits with its status"
  )
)

// ---- stop ----

export const stopCommand = Command.make(
  "stop",
  {
    ref: sessionRef,
    timeout: durationOption("timeout", "how long Close may take before the kill path (default 60s)"),
    json
  },
  (args) =>
    edge({ json: args.json, scrub: false })(
      Effect.gen(function* () {
        const result = yield* stop(args.ref, { timeout: Option.getOrUndefined(args.timeout) })
        if (args.json) yield* printJson(result)
        else
          yield* Console.error(
            `abox: session ${escapeControl(args.ref)} ${result.how} (supervisor pid ${result.pid})`
          )
      })
    )
).pipe(Command.withDescription("close a running session: its supervisor runs Close and exits"))

// ---- suspend ----

export const suspendCommand = Command.make(
  "suspend",
  {
    ref: sessionRef,
    timeout: durationOption(
      "timeout",
      "how long the save and Close may take before the kill path (default 60s)"
    ),
    json
  },
  (args) =>
    edge({ json: args.json, scrub: false })(
      Effect.gen(function* () {
        const result = yield* stop(args.ref, { timeout: Option.getOrUndefined(args.timeout), suspend: true })
        if (args.json) yield* printJson({ ...result, suspended: true })
        else
          yield* Console.error(
            `abox: session ${escapeControl(args.ref)} suspended (supervisor pid ${result.pid}); abox start ${escapeControl(args.ref)} restores it`
          )
      })
    )
).pipe(
  Command.withDescription(
    "save a running session's memory beside its disks and end its VM: the next start, resume or exec restores it, processes and all (QEMU)"
  )
)

// ---- attach ----

const HELP =
  "type a prompt for the agent (a turn for the agent command if the session has one) and press Enter · !cmd runs a shell command · Ctrl-C cancels your running turn · Ctrl-D or /detach leaves (the session keeps running)"

export const attachCommand = Command.make(
  "attach",
  {
    ref: sessionRef,
    watch: Options.boolean("watch").pipe(
      Options.withDescription("only watch (never type), even if nobody types")
    )
  },
  (args) =>
    edge({ json: false, scrub: false })(
      Effect.scoped(
        Effect.gen(function* () {
          const connection = yield* connect(args.ref)
          yield* connection.send({ type: "attach", typist: !args.watch })
          const first = yield* connection.next
          if (Option.isNone(first))
            return yield* new ControlError({
              reason: "closed",
              message: "the supervisor closed the connection"
            })
          if (first.value.type === "error") return yield* remoteError(first.value.error)
          const typist = first.value.type === "attached" && first.value.typist
          // a typed line: `!cmd` a shell command, else a prompt (a turn for the agent command if it has one)
          const lines = (first.value.type === "attached" ? first.value.lines : undefined) ?? "prompt"
          process.stderr.write(
            `abox: attached to ${connection.sessionId} (${typist ? "you type" : "watching"})\n${typist ? HELP + "\n" : ""}`
          )
          const rl = yield* Effect.acquireRelease(
            Effect.sync(() =>
              readline.createInterface({
                input: process.stdin,
                output: process.stderr,
                terminal: process.stdin.isTTY === true
              })
            ),
            (rl) => Effect.sync(() => rl.close())
          )
          rl.setPrompt("abox> ")
          // turns this client typed that have not ended: at the end of its input it waits for them
          const outstanding = yield* SubscriptionRef.make(0)
          const mine = new Set<number>()
          const prompt = () => (typist ? Effect.sync(() => rl.prompt()) : Effect.void)
          // typed lines become turns; Ctrl-C cancels our running turn; Ctrl-D / /detach leave
          const input = Stream.async<string>((emit) => {
            rl.on("line", (line) => void emit.single(line))
            rl.on("close", () => void emit.end())
            rl.on("SIGINT", () => void emit.single("\u0003"))
          }).pipe(
            Stream.takeWhile((line) => line.trim() !== "/detach"),
            Stream.runForEach((line) => {
              if (!typist) return Effect.void
              if (line === "\u0003") return connection.send({ type: "cancel" })
              const turn = parseLine(line.trim(), lines)
              return turn.text === ""
                ? prompt()
                : Effect.zipRight(
                    SubscriptionRef.update(outstanding, (n) => n + 1),
                    connection.send({
                      type: "turn",
                      text: turn.text,
                      ...(turn.mode === "prompt" ? { mode: "prompt" } : {})
                    })
                  )
            }),
            Effect.zipRight(
              outstanding.changes.pipe(
                Stream.takeUntil((n) => n <= 0),
                Stream.runDrain
              )
            )
          )
          const output = connection.replies.pipe(
            Stream.runForEach((reply) => {
              switch (reply.type) {
                case "turn_started":
                  return Effect.sync(() => {
                    if (reply.mine === true) mine.add(reply.turn)
                    process.stderr.write(`· turn ${reply.turn}: ${escapeControl(reply.text)}\n`)
                  })
                case "event":
                  return printEvent(agentTurnEvent(reply.event))
                case "turn_end": {
                  const code = exitStatus(reply)
                  const own = mine.delete(reply.turn)
                  return Effect.zipRight(
                    own ? SubscriptionRef.update(outstanding, (n) => n - 1) : Effect.void,
                    Effect.zipRight(
                      Effect.sync(() =>
                        process.stderr.write(
                          `· turn ${reply.turn} ended${code !== 0 ? `: exit ${code}` : ""}${reply.timedOut ? " (timed out)" : reply.cancelled ? " (cancelled)" : ""}\n`
                        )
                      ),
                      prompt()
                    )
                  )
                }
                case "error":
                  return Effect.zipRight(
                    Effect.sync(() =>
                      process.stderr.write(`abox: ${escapeControl(remoteError(reply.error).message)}\n`)
                    ),
                    SubscriptionRef.update(outstanding, (n) => n - 1)
                  )
                default:
                  return Effect.void
              }
            }),
            Effect.zipRight(Effect.sync(() => process.stderr.write("\nabox: the session closed\n")))
          )
          yield* prompt()
          // a watcher reads no input: it leaves on a signal or when the session closes
          yield* Effect.raceFirst(typist ? input : Effect.never, output)
        })
      )
    )
).pipe(
  Command.withDescription(
    "the interactive mode of a running session: every client sees every turn; the first that asks types"
  )
)

// ---- forward ----

const portArg = (name: string) =>
  Args.integer({ name }).pipe(
    Args.mapEffect((port) =>
      port >= 0 && port <= 65535
        ? Effect.succeed(port)
        : Effect.fail(HelpDoc.p(`${name}: not a port number: ${port}`))
    )
  )

export const forwardCommand = Command.make(
  "forward",
  {
    ref: sessionRef,
    guestPort: portArg("guestPort").pipe(Args.withDescription("the port in the guest (its 127.0.0.1)")),
    hostPort: portArg("hostPort").pipe(
      Args.optional,
      Args.withDescription("the port on the host's 127.0.0.1 (default: the guest port; 0: any free one)")
    )
  },
  (args) =>
    edge({ json: false, scrub: false })(
      Effect.scoped(
        forward(
          args.ref,
          args.guestPort,
          Option.getOrElse(args.hostPort, () => args.guestPort),
          {
            onListening: (port) =>
              Console.log(`forwarding 127.0.0.1:${port} -> guest 127.0.0.1:${args.guestPort} (Ctrl-C stops)`),
            onRefused: (error) => Console.error(`abox: ${escapeControl(error.message)}`)
          }
        )
      ).pipe(Effect.zipRight(Console.error("abox: the session closed")))
    )
).pipe(
  Command.withDescription(
    "forward 127.0.0.1:<hostPort> on the host to 127.0.0.1:<guestPort> in a running session (over the protocol; the guest has no network)"
  )
)
