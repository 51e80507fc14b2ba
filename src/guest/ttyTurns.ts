/**
 * TTY turns (`abox exec -it`): a command on a pseudo-terminal in the guest.
 *
 * Node cannot make a usable pty without a native addon, so the pty comes from BusyBox's
 * `telnetd` in inetd mode (`busybox telnetd -i -f /dev/null -l <wrapper>`): it opens the pty,
 * starts the wrapper in a new session with the pty as its controlling terminal, and speaks telnet
 * over its own stdin/stdout pipes. This module is the telnet side:
 *
 * - output: negotiation (`IAC WILL/WONT/DO/DONT x`, other `IAC x`) and `IAC SB … IAC SE` blocks are
 *   dropped, `IAC IAC` is one 0xFF byte, and the `\r\r\n` telnetd writes before the command's
 *   first byte is dropped;
 * - input: 0xFF is doubled, `\r` is sent as `\r\0`; a resize is NAWS
 *   (`IAC SB 31 w_hi w_lo h_hi h_lo IAC SE`, 0xFF doubled there too);
 * - telnetd always exits 0: the wrapper writes the command's status and its own pid (`$$`, the
 *   new session's process group) into two files the turn user owns, in a per-turn directory the
 *   agent owns (0711: the user can neither add, rename nor remove an entry of it, so the agent's
 *   reads and its final `rm` touch only what it made itself); the agent reads those files with
 *   O_NOFOLLOW | O_NONBLOCK, a regular file only, a few bytes;
 * - the pid in that file is the user's word: the agent signals it as the user (`busybox kill`
 *   with the user's uid), so a pid naming a root process reaches nothing;
 * - telnetd's stdin stays open for the whole turn (closing it ends the command);
 * - cancel and forwarded signals go to telnetd's process group and to the wrapper's.
 */
import { spawn, type ChildProcess } from "node:child_process"
import { constants as fsConstants } from "node:fs"
import * as fs from "node:fs/promises"
import * as os from "node:os"
import * as path from "node:path"
import type { TurnSignalName } from "../protocol/Messages.js"
import { OutputChunker, turnEnv, type EventSink, type TurnEnvironment, type TurnOutcome } from "./turns.js"
import { killGroup } from "./processGroup.js"
import { TurnSlot, type TurnClaim } from "./turnSlot.js"
import type { TurnUser } from "./user.js"

const IAC = 0xff
const SB = 0xfa
const SE = 0xf0
const WILL = 0xfb
const DONT = 0xfe
const NAWS = 31

/** the signals a host may forward to a tty turn's command (turn_signal's fixed set) */
export type TtySignal = typeof TurnSignalName.Type

/** the busybox binary that provides telnetd (the image's and the test host's) */
export const BUSYBOX = "/bin/busybox"

/** a terminal dimension as NAWS carries it (1–65535; 0 would mean "unknown") */
const dimension = (n: number): number => Math.max(1, Math.min(0xffff, Math.trunc(n)))

/** the bytes the command reads: 0xFF doubled, CR followed by NUL (telnet's bare CR) */
export const encodeInput = (bytes: Uint8Array): Buffer => {
  const out: Array<number> = []
  for (const b of bytes) {
    out.push(b)
    if (b === IAC) out.push(IAC)
    else if (b === 0x0d) out.push(0)
  }
  return Buffer.from(out)
}

/** NAWS: the terminal's size (columns, then rows), 0xFF doubled inside the block */
export const encodeResize = (rows: number, cols: number): Buffer => {
  const w = dimension(cols)
  const h = dimension(rows)
  const body: Array<number> = []
  for (const b of [w >> 8, w & 0xff, h >> 8, h & 0xff]) {
    body.push(b)
    if (b === IAC) body.push(IAC)
  }
  return Buffer.from([IAC, SB, NAWS, ...body, IAC, SE])
}

const LEADING = Buffer.from("\r\r\n")

/** telnetd's output → the terminal's bytes (a state machine: sequences may be cut by reads) */
export class TelnetDecoder {
  private state: "data" | "iac" | "option" | "sb" | "sb_iac" = "data"
  /** bytes of the stream's start that may still be telnetd's leading `\r\r\n` */
  private prefix: Array<number> | undefined = []

  push(chunk: Uint8Array): Buffer {
    const out: Array<number> = []
    for (const b of chunk) {
      switch (this.state) {
        case "data":
          if (b === IAC) this.state = "iac"
          else this.data(b, out)
          break
        case "iac":
          if (b === IAC) {
            this.data(IAC, out)
            this.state = "data"
          } else if (b === SB) this.state = "sb"
          else if (b >= WILL && b <= DONT) this.state = "option"
          else this.state = "data" // a two-byte command (NOP, GA, …)
          break
        case "option":
          this.state = "data"
          break
        case "sb":
          if (b === IAC) this.state = "sb_iac"
          break
        case "sb_iac":
          this.state = b === SE ? "data" : "sb"
          break
      }
    }
    return Buffer.from(out)
  }

  /** the stream ended: a partial leading sequence was the command's own bytes */
  end(): Buffer {
    const rest = this.prefix ?? []
    this.prefix = undefined
    return Buffer.from(rest)
  }

  private data(b: number, out: Array<number>): void {
    const prefix = this.prefix
    if (prefix === undefined) {
      out.push(b)
      return
    }
    prefix.push(b)
    if (b !== LEADING[prefix.length - 1]) {
      out.push(...prefix)
      this.prefix = undefined
    } else if (prefix.length === LEADING.length) {
      this.prefix = undefined // telnetd's, not the command's
    }
  }
}

const shellQuote = (text: string): string => `'${text.replaceAll("'", `'\\''`)}'`

/** the program telnetd starts on the pty: size, the command, its status and the session's pid */
export const wrapperScript = (dir: string, text: string, rows: number, cols: number): string =>
  [
    "#!/bin/sh",
    // the wrapper outlives ^C (the command gets the default handling) to record the status
    "trap : INT TERM HUP QUIT",
    `echo $$ > ${shellQuote(path.join(dir, "pid"))}`,
    `stty rows ${dimension(rows)} cols ${dimension(cols)} 2>/dev/null`,
    // the working directory is telnetd's (the repository, entered before the uid changes, as for
    // other turns)
    `/bin/sh -c ${shellQuote(text)}`,
    // the file exists (the agent made it, the user's): one small write
    `echo $? > ${shellQuote(path.join(dir, "status"))}`,
    ""
  ].join("\n")

/** a number the turn user wrote: a regular file only (never a FIFO's wait), a few bytes of it */
const readInt = async (file: string): Promise<number | undefined> => {
  let handle: fs.FileHandle | undefined
  try {
    handle = await fs.open(file, fsConstants.O_RDONLY | fsConstants.O_NOFOLLOW | fsConstants.O_NONBLOCK)
    if (!(await handle.stat()).isFile()) return undefined
    const buffer = Buffer.alloc(16)
    const { bytesRead } = await handle.read(buffer, 0, buffer.length, 0)
    const text = buffer.subarray(0, bytesRead).toString("utf8").trim()
    if (!/^\d{1,10}$/.test(text)) return undefined
    return Number(text)
  } catch {
    return undefined
  } finally {
    await handle?.close()
  }
}

interface Running {
  readonly claim: TurnClaim
  readonly child: ChildProcess
  readonly dir: string
}

export interface TtyTurnOptions {
  readonly rows: number
  readonly cols: number
  /** the local terminal's TERM (absent: not set) */
  readonly term?: string | undefined
}

/** `busybox kill -SIG -pgid` as `user`; resolves when it has run (a failure is the group gone) */
const signalGroupAs = (busybox: string, user: TurnUser, pid: number, signal: NodeJS.Signals): Promise<void> =>
  new Promise<void>((resolve) => {
    const child = spawn(busybox, ["kill", `-${signal.replace(/^SIG/, "")}`, `-${pid}`], {
      env: {},
      stdio: "ignore",
      uid: user.uid,
      gid: user.gid
    })
    child.once("error", () => resolve())
    child.once("exit", () => resolve())
  })

export class TtyTurnRunner {
  private running: Running | undefined

  constructor(
    private readonly env: TurnEnvironment,
    private readonly busybox: string = BUSYBOX,
    /** the guest's one turn slot, shared with the other kinds of turn */
    private readonly slot: TurnSlot = new TurnSlot()
  ) {}

  /** the tty turn being run, if any */
  get current(): number | undefined {
    return this.running?.claim.turn
  }

  /**
   * A process group the turn user named (the wrapper's pid file): signalled with the user's
   * own rights, so a number naming a root process group reaches nothing; resolves when sent.
   */
  private signalAsUser(pid: number | undefined, signal: NodeJS.Signals): Promise<void> {
    const user = this.env.user
    if (pid === undefined || pid <= 1) return Promise.resolve()
    if (user === undefined) {
      killGroup(pid, signal)
      return Promise.resolve()
    }
    return signalGroupAs(this.busybox, user, pid, signal)
  }

  /** Runs one tty turn to its end; rejects only when it cannot start (no busybox, no temp dir). */
  async run(turn: number, text: string, options: TtyTurnOptions, sink: EventSink): Promise<TurnOutcome> {
    const claim = this.slot.claim(turn)
    const user = this.env.user
    // the agent's own directory: the user enters it and writes the two files made for it there
    let dir: string
    try {
      dir = await fs.mkdtemp(path.join(os.tmpdir(), "abox-tty-"))
    } catch (error) {
      claim.release()
      throw error
    }
    try {
      await fs.chmod(dir, 0o711)
      await fs.writeFile(path.join(dir, "wrapper"), wrapperScript(dir, text, options.rows, options.cols), {
        mode: 0o755
      })
      for (const name of ["pid", "status"]) {
        const handle = await fs.open(
          path.join(dir, name),
          fsConstants.O_WRONLY | fsConstants.O_CREAT | fsConstants.O_EXCL | fsConstants.O_NOFOLLOW,
          0o600
        )
        try {
          if (user !== undefined) await handle.chown(user.uid, user.gid)
        } finally {
          await handle.close()
        }
      }
    } catch (error) {
      claim.release()
      await fs.rm(dir, { recursive: true, force: true })
      throw error
    }
    const child = spawn(this.busybox, ["telnetd", "-i", "-f", "/dev/null", "-l", path.join(dir, "wrapper")], {
      cwd: this.env.repoDir,
      env: { ...turnEnv(this.env), ...(options.term === undefined ? {} : { TERM: options.term }) },
      detached: true,
      stdio: ["pipe", "pipe", "ignore"],
      ...(user === undefined ? {} : { uid: user.uid, gid: user.gid })
    })
    const running: Running = { claim, child, dir }
    this.running = running
    child.stdin!.on("error", () => undefined)
    try {
      await new Promise<void>((resolve, reject) => {
        child.once("spawn", resolve)
        child.once("error", reject)
      })
    } catch (error) {
      this.running = undefined
      claim.release()
      await fs.rm(dir, { recursive: true, force: true })
      throw error
    }
    const decoder = new TelnetDecoder()
    const chunker = new OutputChunker("stdout")
    const pumped = (async () => {
      for await (const chunk of child.stdout! as AsyncIterable<Buffer>) {
        for (const event of chunker.push(decoder.push(chunk))) await sink(event)
      }
      for (const event of chunker.push(decoder.end())) await sink(event)
      for (const event of chunker.end()) await sink(event)
    })()
    await new Promise<void>((resolve) => child.once("exit", () => resolve()))
    await Promise.race([pumped.catch(() => undefined), new Promise((done) => setTimeout(done, 1000).unref())])
    child.stdout?.destroy()
    child.stdin?.destroy()
    await this.signalAsUser(await readInt(path.join(dir, "pid")), "SIGKILL")
    const status = await readInt(path.join(dir, "status"))
    claim.release()
    if (this.running === running) this.running = undefined
    await fs.rm(dir, { recursive: true, force: true })
    if (status === undefined || status > 255) return { exitCode: null, signal: "SIGKILL", cancelled: claim.cancelled }
    return { exitCode: status, signal: null, cancelled: claim.cancelled }
  }

  private target(turn: number): Running | undefined {
    const running = this.running
    return running !== undefined && running.claim.turn === turn ? running : undefined
  }

  /** bytes typed on the client's terminal; false when `turn` is not running */
  input(turn: number, bytes: Uint8Array): boolean {
    const running = this.target(turn)
    if (running === undefined) return false
    running.child.stdin?.write(encodeInput(bytes))
    return true
  }

  resize(turn: number, rows: number, cols: number): boolean {
    const running = this.target(turn)
    if (running === undefined) return false
    running.child.stdin?.write(encodeResize(rows, cols))
    return true
  }

  /** one of TTY_SIGNALS to the command's session and telnetd's group */
  async signal(turn: number, signal: TtySignal): Promise<boolean> {
    const running = this.target(turn)
    if (running === undefined) return false
    await this.signalAsUser(await readInt(path.join(running.dir, "pid")), signal)
    if (signal === "SIGKILL") killGroup(running.child.pid, signal)
    return true
  }

  cancel(turn: number): boolean {
    const running = this.target(turn)
    if (running === undefined) return false
    const pidFile = path.join(running.dir, "pid")
    // SIGTERM to the command's session (the wrapper records 143; telnetd then ends on its own),
    // or to telnetd's group while the wrapper has not started; SIGKILL to both after the bound
    running.claim.terminate((signal) => {
      if (signal === "SIGTERM") {
        void readInt(pidFile).then((pid) =>
          pid === undefined ? killGroup(running.child.pid, "SIGTERM") : this.signalAsUser(pid, "SIGTERM")
        )
        return
      }
      void readInt(pidFile).then((pid) => this.signalAsUser(pid, "SIGKILL"))
      killGroup(running.child.pid, "SIGKILL")
    }, this.env.killAfterMs)
    return true
  }

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

  killNow(): void {
    killGroup(this.running?.child.pid, "SIGKILL")
  }
}
