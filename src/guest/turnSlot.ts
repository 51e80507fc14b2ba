/**
 * The guest's one running turn, whichever its kind (shell, tty, prompt): the runners claim this
 * slot for a turn and release it at the turn's end; the agent asks it whether a turn runs. A
 * claim also carries the turn's cancel: once only, and for a process turn SIGTERM at once and
 * SIGKILL after a bound unless the turn ended first.
 */

/** SIGTERM → SIGKILL bound of a cancelled turn (ms), unless its environment says otherwise */
export const DEFAULT_KILL_AFTER_MS = 2000

/** what a process turn's cancel sends, and to whom, as the runner knows it */
export type Terminate = (signal: "SIGTERM" | "SIGKILL") => void

export class TurnClaim {
  private killTimer: NodeJS.Timeout | undefined
  private wasCancelled = false

  constructor(
    readonly turn: number,
    private readonly slot: TurnSlot
  ) {}

  get cancelled(): boolean {
    return this.wasCancelled
  }

  /** marks the turn cancelled; true the first time (the cancel is to be carried out), false after */
  cancel(): boolean {
    if (this.wasCancelled) return false
    this.wasCancelled = true
    return true
  }

  /** the first cancel of a process turn: SIGTERM now, SIGKILL after `killAfterMs` unless it ended */
  terminate(send: Terminate, killAfterMs: number = DEFAULT_KILL_AFTER_MS): void {
    if (!this.cancel()) return
    send("SIGTERM")
    this.killTimer = setTimeout(() => send("SIGKILL"), killAfterMs)
    this.killTimer.unref()
  }

  /** the turn has ended: no SIGKILL follows, and the slot is free for the next turn */
  release(): void {
    if (this.killTimer !== undefined) clearTimeout(this.killTimer)
    this.killTimer = undefined
    this.slot.free(this)
  }
}

export class TurnSlot {
  private held: TurnClaim | undefined

  /** the turn being run, if any */
  get current(): number | undefined {
    return this.held?.turn
  }

  /** the slot for `turn`; throws while another turn holds it */
  claim(turn: number): TurnClaim {
    if (this.held !== undefined) throw new Error(`turn ${this.held.turn} is still running`)
    const claim = new TurnClaim(turn, this)
    this.held = claim
    return claim
  }

  /** @internal TurnClaim.release */
  free(claim: TurnClaim): void {
    if (this.held === claim) this.held = undefined
  }
}
