/**
 * Prompt turns (`user_turn` with `mode: "prompt"`): the model agent, loaded from its own bundle
 * (abox-guest-model.cjs, beside the agent's bundle or in /opt/abox) on the first prompt turn
 * only, so that the agent's start — every boot's critical path, V8-snapshotted — never pays for
 * the model stack. Plain async TypeScript like the rest of the agent's start-up path.
 */
import { existsSync } from "node:fs"
import { createRequire } from "node:module"
import * as path from "node:path"
import type { ModelSpec } from "../protocol/GuestConfig.js"
import type { ModelAgent, ModelAgentOptions, PromptOutcome } from "./model/index.js"
import type { TurnLimits } from "../protocol/Messages.js"
import type { EventSink, TurnOutcome } from "./turns.js"
import { TurnSlot, type TurnClaim } from "./turnSlot.js"
import type { TurnUser } from "./user.js"

export const MODEL_BUNDLE = "abox-guest-model.cjs"

export interface ModelModule {
  readonly createModelAgent: (options: ModelAgentOptions) => ModelAgent
}

/** beside the running bundle (dist/, /opt/abox/), else the image's /opt/abox */
export const modelBundlePath = (): string => {
  const script = process.argv[1]
  const candidates = [
    ...(script !== undefined && script.endsWith(".js") && path.isAbsolute(script)
      ? [path.join(path.dirname(script), MODEL_BUNDLE)]
      : []),
    path.join("/opt/abox", MODEL_BUNDLE)
  ]
  return candidates.find((candidate) => existsSync(candidate)) ?? candidates[0]!
}

export const loadModelBundle = async (): Promise<ModelModule> => {
  const file = modelBundlePath()
  return createRequire(file)(file) as ModelModule
}

export interface PromptEnvironment {
  readonly spec: ModelSpec | undefined
  readonly maxSteps?: number | undefined
  readonly repoDir: string
  readonly user: TurnUser | undefined
  readonly env: Readonly<Record<string, string>>
  readonly messages: ReadonlyArray<unknown>
  readonly proxyPort?: number | undefined
  readonly caPems?: ReadonlyArray<string> | undefined
  readonly log: (line: string) => void
  /** after each completed step of a prompt turn (context.json is saved) */
  readonly onStep?: ((messages: ReadonlyArray<unknown>) => Promise<void>) | undefined
  /** how the model module is loaded (tests: the sources) */
  readonly load?: () => Promise<ModelModule>
}

/** a prompt turn's end as `turn_end` says it: 0 done, 1 error, 2 a limit (max steps, max cost); cancelled: null */
export const promptExit = (outcome: PromptOutcome): TurnOutcome => ({
  exitCode:
    outcome.reason === "done"
      ? 0
      : outcome.reason === "max_steps" || outcome.reason === "max_cost"
        ? 2
        : outcome.reason === "cancelled"
          ? null
          : 1,
  signal: null,
  cancelled: outcome.reason === "cancelled"
})

export class PromptRunner {
  private agent: Promise<ModelAgent> | undefined
  private loaded: ModelAgent | undefined
  private running: TurnClaim | undefined

  constructor(
    private readonly env: PromptEnvironment,
    /** the guest's one turn slot, shared with the other kinds of turn */
    private readonly slot: TurnSlot = new TurnSlot()
  ) {}

  /** the prompt turn being run, if any */
  get current(): number | undefined {
    return this.running?.turn
  }

  /** the conversation to keep in context.json (as loaded until the model bundle is) */
  async messages(): Promise<ReadonlyArray<unknown>> {
    return this.agent === undefined ? this.env.messages : (await this.agent).messages()
  }

  private model(): Promise<ModelAgent> {
    this.agent ??= (this.env.load ?? loadModelBundle)().then((module) => {
      const { load: _load, ...options } = this.env
      this.loaded = module.createModelAgent(options)
      return this.loaded
    })
    return this.agent
  }

  async run(turn: number, text: string, sink: EventSink, limits?: TurnLimits): Promise<TurnOutcome> {
    const running = this.slot.claim(turn)
    this.running = running
    try {
      const agent = await this.model()
      if (running.cancelled) {
        await sink({ kind: "agent_end", reason: "cancelled", steps: 0, message: "cancelled" })
        return { exitCode: null, signal: null, cancelled: true }
      }
      return promptExit(await agent.run(text, sink, limits))
    } finally {
      running.release()
      if (this.running === running) this.running = undefined
    }
  }

  cancel(turn: number): boolean {
    const running = this.running
    if (running === undefined || running.turn !== turn) return false
    running.cancel()
    void this.agent?.then((agent) => agent.cancel())
    return true
  }

  /** last resort on the way out: nothing a tool started survives us */
  killNow(): void {
    this.loaded?.killNow()
  }

  async stop(): Promise<void> {
    if (this.running !== undefined) this.cancel(this.running.turn)
    if (this.agent !== undefined) await (await this.agent).close()
  }
}
