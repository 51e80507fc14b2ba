/**
 * Turns: one process tree per turn, run as the unprivileged user with a clean environment.
 *
 * - Default agent: `/bin/sh -c <text>` in the repo; stdout/stderr chunks become events as they come.
 * - Configured agent (`GuestConfig.agent.argv`): the argv (`{model}` replaced by the model alias)
 *   with the turn text on stdin; each stdout line that is JSON becomes `{kind:"json"}`, other
 *   lines `stdout`; stderr chunks stay `stderr`.
 * - Each turn is its own process group (spawn detached): cancel sends SIGTERM to the group, then
 *   SIGKILL after `killAfterMs`. When the turn's main process exits, whatever it left running in
 *   its group is killed too, so no turn outlives its `turn_end`.
 * - Only a fixed environment reaches a turn: PATH, HOME, USER, LANG, ABOX_MODEL (+ the egress
 *   proxy variables from the caller). The agent's own environment is not passed through.
 */
import { spawn, type ChildProcess } from "node:child_process"
import { StringDecoder } from "node:string_decoder"
import * as Either from "effect/Either"
import * as Schema from "effect/Schema"
import type { AgentEvent } from "../protocol/Messages.js"
import { MAX_OUTPUT_RECORD } from "../protocol/TurnOutput.js"
import { killGroup } from "./processGroup.js"
import { TurnSlot, type TurnClaim } from "./turnSlot.js"
import type { TurnUser } from "./user.js"

export const TURN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
/** one event carries at most this many characters; longer output is split */
export const MAX_EVENT_CHARS = 16 * 1024
/** one stdout/stderr event carries at most this many bytes of output */
export const MAX_EVENT_BYTES = 16 * 1024

export interface TurnEnvironment {
  readonly repoDir: string
  readonly model: string
  /** run as this user (root only); undefined: run as the agent's own user */
  readonly user: TurnUser | undefined
  /** absent: the default shell agent */
  readonly agentArgv?: ReadonlyArray<string> | undefined
  /** more variables for turn processes (the egress proxy and CA bundle) */
  readonly extraEnv?: Readonly<Record<string, string>>
  /** SIGTERM → SIGKILL bound when cancelling (ms) */
  readonly killAfterMs?: number
}

export interface TurnOutcome {
  readonly exitCode: number | null
  readonly signal: string | null
  readonly cancelled: boolean
}

/** events are awaited: the sender's back pressure (the mux) pauses reading the turn's output */
export type EventSink = (event: AgentEvent) => Promise<void> | void

const decodeJsonLine = Schema.decodeUnknownEither(Schema.parseJson())

export const turnEnv = (env: TurnEnvironment): Record<string, string> => ({
  PATH: TURN_PATH,
  HOME: env.user?.home ?? process.env.HOME ?? "/",
  USER: env.user?.name ?? process.env.USER ?? "root",
  LANG: "C.UTF-8",
  ABOX_MODEL: env.model,
  ...env.extraEnv
})

const split = (text: string): ReadonlyArray<string> => {
  if (text.length <= MAX_EVENT_CHARS) return [text]
  const parts: Array<string> = []
  for (let i = 0; i < text.length; i += MAX_EVENT_CHARS) parts.push(text.slice(i, i + MAX_EVENT_CHARS))
  return parts
}

// ignoreBOM: a leading U+FEFF stays in the text, so the text re-encodes to the same bytes
const strictUtf8 = new TextDecoder("utf-8", { fatal: true, ignoreBOM: true })
const lossyUtf8 = new TextDecoder("utf-8", { ignoreBOM: true })

/** how many bytes at the end of `bytes` begin a UTF-8 sequence that is not complete yet (0–3) */
export const incompleteUtf8Tail = (bytes: Uint8Array): number => {
  for (let back = 1; back <= Math.min(3, bytes.length); back++) {
    const b = bytes[bytes.length - back]!
    if ((b & 0xc0) === 0x80) continue // a continuation byte: its lead is further back
    const length = b >= 0xf0 ? 4 : b >= 0xe0 ? 3 : b >= 0xc0 ? 2 : 1
    return length > back ? back : 0
  }
  return 0
}

/** one output event: text when the bytes are UTF-8, else the exact bytes in `base64` (protocol v4) */
export const outputEvent = (kind: "stdout" | "stderr", bytes: Uint8Array): AgentEvent => {
  try {
    return { kind, data: strictUtf8.decode(bytes) }
  } catch {
    return { kind, data: lossyUtf8.decode(bytes), base64: Buffer.from(bytes).toString("base64") }
  }
}

/**
 * A turn's output stream cut in pieces of at most `max` bytes, byte-exact: the pieces
 * concatenated are the stream. A UTF-8 sequence cut by a read waits for its rest, so that text
 * stays text (the last piece, at the stream's end, is sent as it is).
 */
export class ByteChunker {
  private carry: Uint8Array = new Uint8Array(0)

  constructor(private readonly max: number) {}

  push(chunk: Uint8Array): ReadonlyArray<Uint8Array> {
    const bytes = this.carry.length === 0 ? chunk : Buffer.concat([this.carry, chunk])
    const pieces: Array<Uint8Array> = []
    let start = 0
    while (bytes.length - start > this.max) {
      const piece = bytes.subarray(start, start + this.max)
      const cut = piece.length - incompleteUtf8Tail(piece)
      pieces.push(piece.subarray(0, cut))
      start += cut
    }
    const rest = bytes.subarray(start)
    const body = rest.length - incompleteUtf8Tail(rest)
    if (body > 0) pieces.push(rest.subarray(0, body))
    this.carry = Uint8Array.from(rest.subarray(body))
    return pieces
  }

  /** the stream ended: a sequence still incomplete is sent as it is (as bytes) */
  end(): ReadonlyArray<Uint8Array> {
    const rest = this.carry
    this.carry = new Uint8Array(0)
    return rest.length === 0 ? [] : [rest]
  }
}

/**
 * A turn's output stream as events of at most MAX_EVENT_BYTES, byte-exact: the events' bytes
 * concatenated are the stream. A UTF-8 sequence cut by a read waits for its rest, so that text
 * stays text; bytes that are not UTF-8 travel as base64.
 */
export class OutputChunker {
  private readonly bytes = new ByteChunker(MAX_EVENT_BYTES)

  constructor(private readonly kind: "stdout" | "stderr") {}

  push(chunk: Uint8Array): ReadonlyArray<AgentEvent> {
    return this.bytes.push(chunk).map((piece) => outputEvent(this.kind, piece))
  }

  /** the stream ended: a sequence still incomplete is sent as it is (as bytes) */
  end(): ReadonlyArray<AgentEvent> {
    return this.bytes.end().map((piece) => outputEvent(this.kind, piece))
  }
}

/**
 * A shell turn's stdout/stderr as raw records on the turn's output channel (FEATURE_OUTPUT):
 * awaited, so the channel's credit (the host's reading) paces the turn's pipes.
 */
export type OutputSink = (kind: "stdout" | "stderr", bytes: Uint8Array) => Promise<void>

const pumpChunks = async (
  stream: NodeJS.ReadableStream,
  kind: "stdout" | "stderr",
  sink: EventSink
): Promise<void> => {
  const chunker = new OutputChunker(kind)
  for await (const chunk of stream as AsyncIterable<Buffer>) {
    for (const event of chunker.push(chunk)) await sink(event)
  }
  for (const event of chunker.end()) await sink(event)
}

const pumpRecords = async (
  stream: NodeJS.ReadableStream,
  kind: "stdout" | "stderr",
  output: OutputSink
): Promise<void> => {
  const chunker = new ByteChunker(MAX_OUTPUT_RECORD)
  for await (const chunk of stream as AsyncIterable<Buffer>) {
    for (const piece of chunker.push(chunk)) await output(kind, piece)
  }
  for (const piece of chunker.end()) await output(kind, piece)
}

const emitLine = async (line: string, sink: EventSink) => {
  const trimmed = line.trim()
  if (trimmed.startsWith("{") || trimmed.startsWith("[")) {
    const parsed = decodeJsonLine(trimmed)
    if (Either.isRight(parsed)) return sink({ kind: "json", value: parsed.right })
  }
  for (const data of split(line)) await sink({ kind: "stdout", data })
}

const pumpLines = async (stream: NodeJS.ReadableStream, sink: EventSink): Promise<void> => {
  const decoder = new StringDecoder("utf8")
  let pending = ""
  for await (const chunk of stream as AsyncIterable<Buffer>) {
    pending += decoder.write(chunk)
    let newline = pending.indexOf("\n")
    while (newline >= 0) {
      await emitLine(pending.slice(0, newline + 1), sink)
      pending = pending.slice(newline + 1)
      newline = pending.indexOf("\n")
    }
    // a runaway line without newlines is flushed in pieces, not buffered without bound
    while (pending.length > MAX_EVENT_CHARS) {
      await sink({ kind: "stdout", data: pending.slice(0, MAX_EVENT_CHARS) })
      pending = pending.slice(MAX_EVENT_CHARS)
    }
  }
  pending += decoder.end()
  if (pending !== "") await emitLine(pending, sink)
}

interface Running {
  readonly claim: TurnClaim
  readonly child: ChildProcess
}

export class TurnRunner {
  private running: Running | undefined

  constructor(
    private readonly env: TurnEnvironment,
    /** the guest's one turn slot, shared with the other kinds of turn */
    private readonly slot: TurnSlot = new TurnSlot()
  ) {}

  /** a shell command's turns can send raw output records (a configured agent's lines may be JSON events) */
  get rawOutput(): boolean {
    return this.env.agentArgv === undefined
  }

  /** the shell or agent turn being run, if any */
  get current(): number | undefined {
    return this.running?.claim.turn
  }

  /**
   * Runs one turn to its end. Rejects only when the process cannot be started at all (the caller
   * turns that into an `error` message); a failing command is a normal outcome with its status.
   */
  /**
   * `output` (a shell turn, the host gave it a channel): stdout and stderr go there as raw
   * records; a configured agent's turn still sends events (its lines may be JSON).
   */
  run(turn: number, text: string, sink: EventSink, output?: OutputSink): Promise<TurnOutcome> {
    let claim: TurnClaim
    try {
      claim = this.slot.claim(turn)
    } catch (error) {
      return Promise.reject(error)
    }
    const argv = this.env.agentArgv
    const [command, args] =
      argv === undefined
        ? ["/bin/sh", ["-c", text]]
        : [argv[0]!, argv.slice(1).map((arg) => arg.replaceAll("{model}", this.env.model))]
    const user = this.env.user
    let child: ChildProcess
    try {
      child = spawn(command, args, {
        cwd: this.env.repoDir,
        env: turnEnv(this.env),
        // its own process group: cancel signals the whole tree, never the agent
        detached: true,
        stdio: [argv === undefined ? "ignore" : "pipe", "pipe", "pipe"],
        ...(user === undefined ? {} : { uid: user.uid, gid: user.gid })
      })
    } catch (error) {
      claim.release()
      return Promise.reject(error)
    }
    const running: Running = { claim, child }
    this.running = running

    return new Promise<TurnOutcome>((resolve, reject) => {
      let spawned = false
      child.once("spawn", () => {
        spawned = true
      })
      child.once("error", (error) => {
        if (!spawned) {
          this.running = undefined
          claim.release()
          reject(error)
        }
      })
      if (argv !== undefined && child.stdin !== null) {
        child.stdin.on("error", () => undefined) // the agent may exit without reading its input
        child.stdin.end(text)
      }
      const raw = argv === undefined ? output : undefined
      const out =
        argv !== undefined
          ? pumpLines(child.stdout!, sink)
          : raw !== undefined
            ? pumpRecords(child.stdout!, "stdout", raw)
            : pumpChunks(child.stdout!, "stdout", sink)
      const err =
        raw !== undefined
          ? pumpRecords(child.stderr!, "stderr", raw)
          : pumpChunks(child.stderr!, "stderr", sink)
      const pumped = Promise.allSettled([out, err])
      child.once("exit", (code, signal) => {
        // leftovers of the turn (background jobs) die with it; their pipes then close
        killGroup(child.pid, "SIGKILL")
        // a process that left the group (setsid) may still hold the pipes: bounded wait, then drop them
        let drainTimer: NodeJS.Timeout | undefined
        const drained = Promise.race([
          pumped,
          new Promise<void>((done) => {
            drainTimer = setTimeout(() => {
              child.stdout?.destroy()
              child.stderr?.destroy()
              done()
            }, 1000)
          })
        ])
        void drained.then(() => {
          clearTimeout(drainTimer)
          claim.release()
          if (this.running === running) this.running = undefined
          resolve({ exitCode: code, signal, cancelled: claim.cancelled })
        })
      })
    })
  }

  /** SIGTERM the turn's process group, SIGKILL after the bound. False when `turn` is not running. */
  cancel(turn: number): boolean {
    const running = this.running
    if (running === undefined || running.claim.turn !== turn) return false
    running.claim.terminate((signal) => killGroup(running.child.pid, signal), this.env.killAfterMs)
    return true
  }

  /** cancel whatever runs (shutdown, lost host) and wait until it has ended */
  async stop(): Promise<void> {
    const running = this.running
    if (running === undefined) return
    const ended = new Promise<void>((resolve) => {
      if (running.child.exitCode !== null || running.child.signalCode !== null) resolve()
      else running.child.once("exit", () => resolve())
    })
    this.cancel(running.claim.turn)
    await ended
  }

  /** last resort on the way out (SIGTERM to the agent): nothing of a turn survives us */
  killNow(): void {
    killGroup(this.running?.child.pid, "SIGKILL")
  }
}
