/**
 * The guest side of the protocol v4 conversation (docs/protocol.md), over a Mux:
 *   hello → ready → [transfer_begin + tar bytes + EOF → transfer_end] → (user_turn → agent_event* →
 *   turn_end)* → shutdown
 * Host messages that are valid v4 but make no sense here (a second turn while one runs, a
 * guest→host message type, a transfer outside the repo) get an `error` message back; the agent
 * never crashes on them. Plain async TypeScript: the guest's start-up path carries no Effect
 * runtime beyond effect/Schema (see main.ts).
 */
import { spawn } from "node:child_process"
import * as fs from "node:fs/promises"
import * as net from "node:net"
import * as path from "node:path"
import type { AgentEvent, ControlMessage, TurnLimits } from "../protocol/Messages.js"
import {
  FEATURE_EXPORT,
  FEATURE_LIMITS,
  FEATURE_OUTPUT,
  FEATURE_RESUME,
  FEATURE_TTY,
  PROTOCOL_VERSION
} from "../protocol/Messages.js"
import { encodeOutputRecord } from "../protocol/TurnOutput.js"
import { INITIAL_WINDOW, type Mux } from "../protocol/Mux.js"
import { saveContext, type ContextTurn } from "./context.js"
import { changedEntries, exportOperands, exportTar } from "./exportTree.js"
import { extractTar } from "./extract.js"
import { baselineDir } from "./repoDisk.js"
import type { PromptRunner } from "./prompts.js"
import type { TurnOutcome, TurnRunner } from "./turns.js"
import type { TtyTurnRunner } from "./ttyTurns.js"
import type { TurnSlot } from "./turnSlot.js"
import { channelDuplex } from "./tunnels.js"
import { errorMessage as errorText } from "../domain/errorMessage.js"

/** where the host thinks the repository is; mapped onto --repo */
export const GUEST_REPO_PATH = "/work/repo"

/** how long a cancelled turn's output channel may wait for credit to send its EOF */
const CANCELLED_OUTPUT_WAIT_MS = 1000

export type AgentLink = Pick<
  Mux,
  "onControl" | "onError" | "onClose" | "sendControl" | "channel" | "close" | "receiveWindow"
> &
  Partial<Pick<Mux, "highestHostChannel">>

export interface GuestAgentOptions {
  readonly link: AgentLink
  readonly arch: string
  readonly build: string
  readonly repoDir: string
  readonly stateDir: string
  readonly runner: TurnRunner
  /** the one turn slot the runners share (one turn at a time, whichever its kind) */
  readonly slot: TurnSlot
  /** tty turns (a pty from BusyBox telnetd); absent: hello does not list FEATURE_TTY */
  readonly tty?: TtyTurnRunner | undefined
  /** prompt turns (the model agent); absent: a prompt turn is refused with an error */
  readonly prompts?: PromptRunner | undefined
  readonly history: ReadonlyArray<ContextTurn>
  /** chown extracted files (root only) */
  readonly owner?: { readonly uid: number; readonly gid: number } | undefined
  /** test images: `shutdown` is ignored so that the host's bounded kill path runs */
  readonly ignoreShutdown?: boolean | undefined
  /** tunnel messages go to the egress proxy when there is one */
  readonly onTunnelMessage?: ((message: ControlMessage) => void) | undefined
  readonly log: (line: string) => void
  readonly now?: () => Date
  /** the repository disk is mounted on repoDir (hello.repoDisk) */
  readonly repoDisk?: boolean | undefined
  /**
   * run before every turn_end (a VM: the guest's `sync`), so that what a turn wrote is on the
   * session's disks once the host hears that it ended, however the VM is stopped after that
   */
  readonly settle?: (() => Promise<void>) | undefined
  /**
   * the VM was restored from its saved memory (`resumed`): set the clock, mix in the entropy,
   * trust a fork's own broker CA. Absent: hello does not list FEATURE_RESUME
   */
  readonly onResumed?:
    ((resumed: Extract<ControlMessage, { readonly type: "resumed" }>) => Promise<void>) | undefined
}

/** why the conversation ended */
export type AgentEnd = "shutdown" | "disconnected" | "protocol_error"

export const archName = (arch: string): string =>
  arch === "x64" ? "x86_64" : arch === "arm64" ? "aarch64" : arch

/** a transfer target as the host names it (/work/repo/...) → a dir inside --repo, or undefined */
export const resolveTarget = (target: string, repoDir: string): string | undefined => {
  const repo = path.resolve(repoDir)
  const normalized = path.posix.normalize(target)
  let resolved: string
  if (normalized === GUEST_REPO_PATH || normalized.startsWith(GUEST_REPO_PATH + "/")) {
    resolved = path.join(repo, normalized.slice(GUEST_REPO_PATH.length))
  } else {
    resolved = path.resolve(repo, normalized)
  }
  return resolved === repo || resolved.startsWith(repo + path.sep) ? resolved : undefined
}

export class GuestAgent {
  private readonly history: Array<ContextTurn>
  private readonly now: () => Date
  private shuttingDown = false
  private turnDone: Promise<void> = Promise.resolve()
  private readonly transfers = new Set<number>()
  /** exports the host stopped (tunnel_close): their failure is no news to it */
  private readonly stoppedExports = new Set<number>()
  /** port forwards the host opened (channel ids) */
  private readonly forwards = new Set<number>()
  private finish: (end: AgentEnd) => void = () => undefined

  constructor(private readonly options: GuestAgentOptions) {
    this.history = [...options.history]
    this.now = options.now ?? (() => new Date())
  }

  get turns(): ReadonlyArray<ContextTurn> {
    return this.history
  }

  /** hello + ready, then serve until shutdown or disconnect; turns are stopped and saved either way */
  async run(): Promise<AgentEnd> {
    const { link } = this.options
    const ended = new Promise<AgentEnd>((resolve) => {
      this.finish = resolve
    })
    link.onControl((message) => this.onMessage(message))
    link.onError((error) => {
      this.options.log(`protocol error from the host: ${error.reason}`)
      // best effort: the mux closes right after reporting
      this.send({ type: "error", code: "protocol_error", message: error.reason }).catch(() => undefined)
      this.finish("protocol_error")
    })
    link.onClose(() => this.finish("disconnected"))
    await this.hello()
    const end = await ended
    this.shuttingDown = true
    await Promise.all([this.options.runner.stop(), this.options.prompts?.stop(), this.options.tty?.stop()])
    await this.turnDone
    await this.save()
    return end
  }

  /** hello + ready: at the start, and again as the answer to `resumed` (with hostChannel) */
  private async hello(resumed = false): Promise<void> {
    const { link } = this.options
    const features = [FEATURE_EXPORT, FEATURE_OUTPUT, FEATURE_LIMITS]
    if (this.options.tty !== undefined) features.push(FEATURE_TTY)
    if (this.options.onResumed !== undefined) features.push(FEATURE_RESUME)
    await link.sendControl({
      type: "hello",
      protocol: PROTOCOL_VERSION,
      arch: this.options.arch,
      build: this.options.build,
      contextTurns: this.history.length,
      // a window above v4's default lets the host keep a transfer's pipe full
      ...(link.receiveWindow > INITIAL_WINDOW ? { window: link.receiveWindow } : {}),
      ...(this.options.repoDisk === true ? { repoDisk: true } : {}),
      features,
      ...(resumed ? { hostChannel: link.highestHostChannel ?? 0 } : {})
    })
    await link.sendControl({ type: "ready" })
  }

  private async resumed(message: Extract<ControlMessage, { readonly type: "resumed" }>): Promise<void> {
    if (this.options.onResumed === undefined) {
      return this.send({
        type: "error",
        code: "unexpected_message",
        message: "resumed: this guest cannot resume"
      })
    }
    try {
      await this.options.onResumed(message)
    } catch (error) {
      this.options.log(`after the resume: ${errorText(error)}`)
    }
    await this.hello(true).catch((error: unknown) =>
      this.options.log(`could not send hello: ${errorText(error)}`)
    )
  }

  private send(message: ControlMessage): Promise<void> {
    if (this.shuttingDown) return Promise.resolve()
    return this.options.link.sendControl(message).catch((error: unknown) => {
      this.options.log(`could not send ${message.type}: ${errorText(error)}`)
    })
  }

  private async settle(): Promise<void> {
    try {
      await this.options.settle?.()
    } catch (error) {
      this.options.log(`could not sync the disks: ${errorText(error)}`)
    }
  }

  /** context.json now (a prompt turn's finished steps; errors are logged, never thrown) */
  readonly saveProgress = (): Promise<void> => this.save()

  private async save(): Promise<void> {
    try {
      const messages = this.options.prompts === undefined ? [] : await this.options.prompts.messages()
      await saveContext(this.options.stateDir, this.history, messages)
    } catch (error) {
      this.options.log(`could not save the context: ${errorText(error)}`)
    }
  }

  private onMessage(message: ControlMessage): void | Promise<unknown> {
    if (this.shuttingDown) return
    switch (message.type) {
      case "transfer_begin":
        void this.transfer(message.channel, message.target, message.baseline === true)
        return
      case "export_begin":
        void this.exportTree(
          message.channel,
          message.tree,
          message.paths,
          message.exclude,
          message.changed === true
        )
        return
      case "user_turn":
        return this.startTurn(
          message.turn,
          message.text,
          message.mode ?? "shell",
          undefined,
          message.output,
          message.limits
        )
      case "cancel":
        // cancelling a turn that already ended is not an error: the two crossed on the wire
        this.options.runner.cancel(message.turn)
        this.options.prompts?.cancel(message.turn)
        this.options.tty?.cancel(message.turn)
        return
      case "tty_turn": {
        const tty = this.options.tty
        if (tty === undefined) return this.noTty(message.type, message.turn)
        const options = { rows: message.rows, cols: message.cols, term: message.term }
        return this.startTurn(message.turn, message.text, "shell", (sink) =>
          tty.run(message.turn, message.text, options, sink)
        )
      }
      // input, resize and signals for a turn that already ended crossed its end on the wire: dropped
      case "turn_input":
        if (this.options.tty === undefined) return this.noTty(message.type, message.turn)
        this.options.tty.input(message.turn, Buffer.from(message.data, "base64"))
        return
      case "turn_resize":
        if (this.options.tty === undefined) return this.noTty(message.type, message.turn)
        this.options.tty.resize(message.turn, message.rows, message.cols)
        return
      case "turn_signal":
        if (this.options.tty === undefined) return this.noTty(message.type, message.turn)
        return this.options.tty.signal(message.turn, message.signal)
      case "shutdown":
        if (this.options.ignoreShutdown === true) {
          this.options.log("shutdown ignored (ignoreShutdown is set in the config)")
          return
        }
        this.options.log("shutdown requested")
        this.finish("shutdown")
        return
      case "resumed":
        return this.resumed(message)
      case "forward_open":
        this.forward(message.channel, message.port)
        return
      case "tunnel_accept":
      case "tunnel_deny":
      case "tunnel_close":
        // the mux has dropped the channel: a forward's socket closes with it; an export's
        // writes fail, which stops its tar (the host stopped reading it)
        if (message.type === "tunnel_close" && this.forwards.delete(message.channel)) return
        if (message.type === "tunnel_close" && this.transfers.has(message.channel)) {
          this.stoppedExports.add(message.channel)
          return
        }
        if (this.options.onTunnelMessage !== undefined) {
          this.options.onTunnelMessage(message)
          return
        }
        return this.send({
          type: "error",
          code: "unexpected_message",
          message: `${message.type}: this guest has no egress proxy`,
          channel: message.channel
        })
      case "error":
        this.options.log(`host reported ${message.code}: ${message.message}`)
        return
      default:
        return this.send({
          type: "error",
          code: "unexpected_message",
          message: `${message.type} is not a host-to-guest message`
        })
    }
  }

  /** a tar of part of the repository or of the baseline, on a host-chosen channel (guest → host) */
  private async exportTree(
    channel: number,
    tree: "repo" | "baseline",
    paths: ReadonlyArray<string>,
    exclude: ReadonlyArray<string>,
    changed = false
  ): Promise<void> {
    const { link, log } = this.options
    if (this.transfers.has(channel)) {
      await this.send({ type: "error", code: "export_failed", message: "channel already in use", channel })
      return
    }
    this.transfers.add(channel)
    const ch = link.channel(channel)
    try {
      const dir = tree === "repo" ? this.options.repoDir : baselineDir(this.options.stateDir)
      const operands = changed
        ? (await changedEntries(this.options.repoDir, baselineDir(this.options.stateDir), exclude))[tree]
        : await exportOperands(dir, paths, exclude)
      const bytes = await exportTar(dir, operands, ch, {
        // the repository is read as the turn user; the baseline is root's
        user: tree === "repo" ? this.options.owner : undefined
      })
      await this.send({ type: "transfer_end", channel, files: 0, bytes })
    } catch (error) {
      if (this.stoppedExports.has(channel)) {
        log(`export on channel ${channel} stopped by the host`)
        return
      }
      log(`export on channel ${channel} failed: ${errorText(error)}`)
      ch.destroy("export failed")
      await this.send({ type: "error", code: "export_failed", message: errorText(error), channel })
    } finally {
      this.transfers.delete(channel)
      this.stoppedExports.delete(channel)
    }
  }

  /** the tar path's baseline: a copy of what was just extracted, root's own (`cp -a`, native) */
  private async copyBaseline(dir: string): Promise<void> {
    const target = baselineDir(this.options.stateDir)
    await fs.rm(target, { recursive: true, force: true })
    await fs.mkdir(target, { recursive: true, mode: 0o700 })
    await new Promise<void>((resolve, reject) => {
      const child = spawn("cp", ["-a", `${dir}/.`, `${target}/`], { stdio: ["ignore", "ignore", "pipe"] })
      let stderr = ""
      child.stderr.on("data", (chunk: Buffer) => {
        stderr += chunk.toString("utf8")
      })
      child.once("error", reject)
      child.once("exit", (code) =>
        code === 0 ? resolve() : reject(new Error(`baseline copy: ${stderr.trim() || `exit ${code}`}`))
      )
    })
  }

  /**
   * A port forward: connect to 127.0.0.1:<port> here, answer forward_accept and pipe the
   * channel both ways (each side's end is an EOF to the other); a refused connection is an
   * `error` naming the channel. Either end closing sends tunnel_close.
   */
  private forward(channel: number, port: number): void {
    const ch = this.options.link.channel(channel)
    if (this.forwards.has(channel) || this.transfers.has(channel)) {
      void this.send({ type: "error", code: "forward_refused", message: "channel already in use", channel })
      return
    }
    this.forwards.add(channel)
    const socket = net.connect({ host: "127.0.0.1", port })
    let connected = false
    socket.once("error", (error) => {
      if (connected) return
      this.forwards.delete(channel)
      ch.destroy("forward refused")
      void this.send({
        type: "error",
        code: "forward_refused",
        message: `127.0.0.1:${port} in the guest: ${errorText(error)}`,
        channel
      })
    })
    socket.once("connect", () => {
      connected = true
      // both ends passed on (the host's EOF read, ours sent): the channel retires by itself; a
      // tunnel_close now could overtake bytes the host has not read yet, so it is only for
      // an abnormal end
      let readEnded = false
      let writeFinished = false
      const duplex = channelDuplex(ch, () => {
        const clean = readEnded && writeFinished
        if (this.forwards.delete(channel) && !clean) void this.send({ type: "tunnel_close", channel })
        socket.destroy()
      })
      duplex.once("end", () => (readEnded = true))
      duplex.once("finish", () => (writeFinished = true))
      socket.on("error", () => duplex.destroy())
      // a clean close waits for the pipes (the duplex ends itself); an abrupt one ends the channel
      socket.on("close", (hadError) => (hadError ? duplex.destroy() : undefined))
      duplex.on("error", () => socket.destroy())
      void this.send({ type: "forward_accept", channel }).then(() => {
        socket.pipe(duplex)
        duplex.pipe(socket)
      })
    })
  }

  private async transfer(channel: number, target: string, baseline = false): Promise<void> {
    const { link, log } = this.options
    const readable = link.channel(channel).readable
    const dir = resolveTarget(target, this.options.repoDir)
    if (dir === undefined || this.transfers.has(channel)) {
      const reason =
        dir === undefined
          ? `target ${JSON.stringify(target)} is outside the repository`
          : "channel already in use"
      // drain the channel so the host's writer is not left waiting for credit
      void (async () => {
        for await (const _chunk of readable) {
          // discarded
        }
      })().catch(() => undefined)
      await this.send({ type: "error", code: "transfer_failed", message: reason, channel })
      return
    }
    this.transfers.add(channel)
    const started = Date.now()
    try {
      const result = await extractTar(
        readable,
        dir,
        this.options.owner === undefined ? {} : { owner: this.options.owner }
      )
      if (baseline) await this.copyBaseline(dir)
      log(
        `transfer on channel ${channel}: ${result.files} files, ${result.bytes} bytes` +
          (result.skipped > 0 ? `, ${result.skipped} special entries skipped` : "") +
          ` in ${Date.now() - started} ms`
      )
      await this.send({ type: "transfer_end", channel, files: result.files, bytes: result.bytes })
    } catch (error) {
      log(`transfer on channel ${channel} failed: ${errorText(error)}`)
      await this.send({ type: "error", code: "transfer_failed", message: errorText(error), channel })
    } finally {
      this.transfers.delete(channel)
    }
  }

  private noTty(type: string, turn: number): Promise<void> {
    return this.send({
      type: "error",
      code: "unexpected_message",
      message: `${type}: this guest has no tty turns`,
      turn
    })
  }

  private startTurn(
    turn: number,
    text: string,
    mode: "shell" | "prompt",
    start?: (sink: (event: AgentEvent) => Promise<void>) => Promise<TurnOutcome>,
    outputChannel?: number,
    limits?: TurnLimits
  ): Promise<void> | void {
    const { runner, prompts } = this.options
    // the host's output channel (FEATURE_OUTPUT) carries a shell command's stdout/stderr; a turn
    // that sends events instead (prompt, configured agent, refused) ends it at once
    const channel = outputChannel === undefined ? undefined : this.options.link.channel(outputChannel)
    const raw = channel !== undefined && mode === "shell" && start === undefined && runner.rawOutput
    const endOutput = async (cancelled = false) => {
      if (channel === undefined) return
      const ended = channel.end().catch(() => undefined)
      // a cancelled turn's host may have stopped reading (it dropped the turn): its EOF waits
      // (bounded) for the credit, then the channel is dropped and turn_end goes anyway
      if (cancelled) {
        let timer: NodeJS.Timeout | undefined
        await Promise.race([
          ended,
          new Promise<void>((done) => (timer = setTimeout(done, CANCELLED_OUTPUT_WAIT_MS)))
        ])
        clearTimeout(timer)
      } else await ended
      channel.destroy("turn output sent")
    }
    if (!raw) void endOutput()
    let outputFailed = false
    // a write the host refused (it dropped the channel) stops sending, never reading: the turn's
    // pipes keep draining until it ends or is cancelled
    const output =
      raw && channel !== undefined
        ? async (kind: "stdout" | "stderr", bytes: Uint8Array) => {
            if (outputFailed) return
            await channel.write(encodeOutputRecord(kind, bytes)).catch(() => {
              outputFailed = true
            })
          }
        : undefined
    const busy = this.options.slot.current
    if (busy !== undefined) {
      if (raw) void endOutput()
      return this.send({
        type: "error",
        code: "turn_busy",
        message: `turn ${busy} is still running; one turn at a time`,
        turn
      })
    }
    if (mode === "prompt" && prompts === undefined) {
      return this.send({
        type: "error",
        code: "no_model_agent",
        message: "this guest has no model agent for prompt turns",
        turn
      })
    }
    const startedAt = this.now().toISOString()
    const sink = (event: AgentEvent) => this.send({ type: "agent_event", turn, event })
    const outcome =
      start !== undefined
        ? start(sink)
        : mode === "prompt" && prompts !== undefined
          ? prompts.run(turn, text, sink, limits)
          : runner.run(turn, text, sink, output)
    this.turnDone = outcome.then(
      async (result) => {
        this.history.push({ turn, text, ...result, startedAt, endedAt: this.now().toISOString() })
        await this.save()
        await this.settle()
        // all output before the end: its EOF goes before turn_end
        if (raw) await endOutput(result.cancelled)
        await this.send({ type: "turn_end", turn, ...result })
      },
      async (error: unknown) => {
        // the process could not start (no shell, bad agent argv): the turn ends as exec failures do
        this.options.log(`turn ${turn} could not start: ${errorText(error)}`)
        this.history.push({
          turn,
          text,
          exitCode: 127,
          signal: null,
          cancelled: false,
          startedAt,
          endedAt: this.now().toISOString()
        })
        await this.save()
        if (raw) await endOutput()
        await this.send({
          type: "agent_event",
          turn,
          event: { kind: "stderr", data: `abox-guest: could not start the turn: ${errorText(error)}\n` }
        })
        await this.send({ type: "turn_end", turn, exitCode: 127, signal: null, cancelled: false })
      }
    )
  }
}
