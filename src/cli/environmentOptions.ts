import * as Options from "@effect/cli/Options"
import * as Prompt from "@effect/cli/Prompt"
import type * as FileSystem from "@effect/platform/FileSystem"
import type * as Path from "@effect/platform/Path"
import type * as Terminal from "@effect/platform/Terminal"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import { escapeControl } from "../lib/text.js"
import type { EnvironmentOptions } from "../programs/environment.js"
import type { TurnEvent } from "../services/GuestRpc.js"
import { writeOutput } from "./turnOutput.js"

/** The flag and the callbacks open, run, start and `env build` share for a repository's environment. */

export const allowEnvHosts = Options.boolean("allow-env-hosts").pipe(
  Options.withDescription(
    "grant the hosts the repository's environment asks for (its `allow`); without it they need your broker.json or a yes on the terminal"
  )
)

/** a setup's or install's output, as it comes, on stderr (stdout stays the turn's) */
const toStderr = (event: TurnEvent) =>
  event._tag === "Event" && (event.event.kind === "stdout" || event.event.kind === "stderr")
    ? writeOutput(process.stderr, event.bytes ?? event.event.data)
    : Effect.void

/**
 * What open, run and env build tell the environment programs: the terminal's consent question
 * (only where stdin and stderr are terminals), the setup's and install's output on stderr
 * (`quiet`: --json, nothing but JSON on stdout, the output still on stderr), notices on stderr.
 */
export const environmentOptions = (allow: boolean) =>
  Effect.gen(function* () {
    const context = yield* Effect.context<Terminal.Terminal | FileSystem.FileSystem | Path.Path>()
    const canAsk = process.stdin.isTTY === true && process.stderr.isTTY === true
    const options: EnvironmentOptions = {
      allowEnvHosts: allow,
      consentHosts: canAsk
        ? (hosts) =>
            Prompt.run(
              Prompt.confirm({
                message: `This repository's environment asks to reach ${hosts.join(", ")} through the broker (HTTPS, no credential added). Allow?`,
                initial: false
              })
            ).pipe(
              Effect.catchAll(() => Effect.succeed(false)),
              Effect.provide(context)
            )
        : undefined,
      onSetupOutput: toStderr,
      onNotice: (line) => Console.error(`abox: ${escapeControl(line)}`)
    }
    return { ...options, onInstallOutput: toStderr }
  })

