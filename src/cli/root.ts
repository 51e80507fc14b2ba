import * as Command from "@effect/cli/Command"
import pkg from "../../package.json" with { type: "json" }

// the constraint of @effect/cli's own `withSubcommands`: the result's types come from each command
// eslint-disable-next-line @typescript-eslint/no-explicit-any
type AnyCommand = Command.Command<any, any, any, any>

/**
 * The `abox` root command over some of its subcommands: all of them (src/cli/main.ts), or the
 * one a command line names (src/cli/dispatch.ts). One definition, so both parse, print help and
 * fail alike.
 */
export const aboxCommand = <const Subcommands extends readonly [AnyCommand, ...Array<AnyCommand>]>(
  subcommands: Subcommands
) =>
  Command.make("abox").pipe(
    Command.withDescription("run an AI coding agent inside a VM session"),
    Command.withSubcommands([...subcommands])
  )

/** the CLI application over a root command: `(argv) => Effect` */
export const runAbox = <Name extends string, R, E, A>(command: Command.Command<Name, R, E, A>) =>
  Command.run(command, { name: "abox", version: pkg.version })
