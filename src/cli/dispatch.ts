import type * as Command from "@effect/cli/Command"
import * as Effect from "effect/Effect"
import type * as Layer from "effect/Layer"
import { BaseLive } from "../layers/Base.js"
import type { MainLive } from "../layers/Main.js"
import type { cli } from "./main.js"
import { aboxCommand, runAbox } from "./root.js"

/** how the whole CLI may fail (its commands, its parser, its services) */
type CliError = Effect.Effect.Error<ReturnType<typeof cli>> | Layer.Layer.Error<typeof MainLive>

/** one run of the CLI over `argv`, every service provided */
export type CliRun = (argv: ReadonlyArray<string>) => Effect.Effect<void, CliError>

type BaseServices = Layer.Layer.Success<typeof BaseLive>

/** the CLI over one subcommand that needs only BaseLive (the type says so) */
const alone =
  <Name extends string, E extends CliError, A>(command: Command.Command<Name, BaseServices, E, A>): CliRun =>
  (argv) =>
    runAbox(aboxCommand([command]))(argv).pipe(Effect.provide(BaseLive))

/**
 * The subcommands that never start a VM (their type says they need BaseLive only), each loaded
 * on its own: `abox list` evaluates the list command, the store and the runtime lock, and never
 * the VM stack (VMM backends, guest RPC, broker, images) or the session programs. Each entry is a dynamic import
 * (a chunk of its own in the bundle: scripts/build.mjs splits dist/abox.js). The root command
 * is the same one as the full CLI's (src/cli/root.ts), so help, errors and exit codes are the
 * same whichever way a command line goes. Not here: a command with subcommands of its own
 * (`image`), whose parse errors list the root's subcommands.
 */
const runsAlone = {
  list: () => import("./commands/list.js").then((m) => alone(m.list)),
  show: () => import("./commands/show.js").then((m) => alone(m.show)),
  name: () => import("./commands/name.js").then((m) => alone(m.name)),
  scrub: () => import("./commands/scrub.js").then((m) => alone(m.scrub)),
  rm: () => import("./commands/rm.js").then((m) => alone(m.rm)),
  prune: () => import("./commands/prune.js").then((m) => alone(m.prune)),
  logs: () => import("./commands/maintenance.js").then((m) => alone(m.logs)),
  gc: () => import("./commands/maintenance.js").then((m) => alone(m.gcCommand)),
  exec: () => import("./commands/detached.js").then((m) => alone(m.execCommand)),
  attach: () => import("./commands/detached.js").then((m) => alone(m.attachCommand)),
  stop: () => import("./commands/detached.js").then((m) => alone(m.stopCommand)),
  suspend: () => import("./commands/detached.js").then((m) => alone(m.suspendCommand)),
  forward: () => import("./commands/detached.js").then((m) => alone(m.forwardCommand)),
  start: () => import("./commands/detached.js").then((m) => alone(m.startCommand))
} satisfies Record<string, () => Promise<CliRun>>

/** the subcommands that run alone */
export const lightCommands: ReadonlyArray<string> = Object.keys(runsAlone)

/** every subcommand, on every service (what any other command line runs) */
const full = (): Promise<CliRun> =>
  Promise.all([import("./main.js"), import("../layers/Main.js")]).then(
    ([main, layers]) =>
      (argv) =>
        main.cli(argv).pipe(Effect.provide(layers.MainLive))
  )

/**
 * The CLI for this command line: the subcommand it names (the first word after `abox`) alone
 * when that one needs no VM, else the whole CLI (every other subcommand, `--help`,
 * `--version`, a typo: @effect/cli sees them all, as before).
 */
export const loadCli = (argv: ReadonlyArray<string>): Promise<CliRun> => {
  const word = argv[2]
  // `abox --version` alone: the root command prints it whichever subcommands it holds
  if (word === "--version" && argv.length === 3) return runsAlone.list()
  return word !== undefined && Object.hasOwn(runsAlone, word) ? runsAlone[word as keyof typeof runsAlone]() : full()
}
