/**
 * The guest agent's command line. The image's init runs it with no flags (every default below is
 * the in-VM layout); FakeVmm passes them all so the same code runs in a temp dir on the host.
 * Plain TypeScript + effect/Schema only: this is on every boot's critical path.
 */
import * as Either from "effect/Either"
import * as ParseResult from "effect/ParseResult"
import * as Schema from "effect/Schema"

export const GUEST_USAGE = `usage: abox-guest [flags]
  --config <path>                  sealed config disk image (default /dev/vdb)
  --rpc <auto|unix:PATH|vsock:PORT|/dev/vportNpM>
                                   host RPC channel (default auto: the virtio-serial port
                                   named abox.rpc, else vsock port 1024)
  --state <dir>                    agent state, holds context.json (default /var/lib/abox)
  --repo <dir>                     the repository copy (default /work/repo)
  --run <dir>                      runtime files turn processes may read: the broker CA
                                   bundle (default /run/abox)
  --user <name|uid:gid>            unprivileged owner of the repo and of every turn process
                                   (default agent)
  --repo-disks <auto|off>          mount the session's repository disks (labels abox-repo,
                                   abox-base) on the repo and the baseline (default auto)
  --on-shutdown <poweroff|exit>    after shutdown: sync + poweroff -f, or exit 0 (default poweroff)
  --session <auto|disk|wait>       where the session comes from: the config disk, or (wait) the
                                   host's first message after a warm snapshot's restore (default
                                   auto: wait when the kernel command line has abox.session=wait)
  --help                           this text`

export const RpcSpec = Schema.Union(
  Schema.Literal("auto"),
  Schema.TemplateLiteral("unix:", Schema.String),
  Schema.TemplateLiteral("vsock:", Schema.Number),
  Schema.TemplateLiteral("/dev/", Schema.String)
)

export const GuestFlags = Schema.Struct({
  config: Schema.NonEmptyString,
  rpc: RpcSpec,
  state: Schema.NonEmptyString,
  repo: Schema.NonEmptyString,
  run: Schema.NonEmptyString,
  user: Schema.NonEmptyString,
  onShutdown: Schema.Literal("poweroff", "exit"),
  repoDisks: Schema.Literal("auto", "off"),
  session: Schema.Literal("auto", "disk", "wait")
})
export type GuestFlags = typeof GuestFlags.Type

export const DEFAULT_FLAGS: GuestFlags = {
  config: "/dev/vdb",
  rpc: "auto",
  state: "/var/lib/abox",
  repo: "/work/repo",
  run: "/run/abox",
  user: "agent",
  onShutdown: "poweroff",
  repoDisks: "auto",
  session: "auto"
}

const flagNames: Record<string, keyof GuestFlags> = {
  "--config": "config",
  "--rpc": "rpc",
  "--state": "state",
  "--repo": "repo",
  "--run": "run",
  "--user": "user",
  "--on-shutdown": "onShutdown",
  "--repo-disks": "repoDisks",
  "--session": "session"
}

export type ParsedArgs = { readonly _tag: "Run"; readonly flags: GuestFlags } | { readonly _tag: "Help" }

const decodeFlags = Schema.decodeUnknownEither(GuestFlags)

/** `--flag value` and `--flag=value`; unknown flags and missing values are errors (a string). */
export const parseArgs = (argv: ReadonlyArray<string>): Either.Either<ParsedArgs, string> => {
  const raw: Record<string, string> = { ...DEFAULT_FLAGS }
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!
    if (arg === "--help" || arg === "-h") return Either.right({ _tag: "Help" })
    const eq = arg.indexOf("=")
    const name = eq > 0 ? arg.slice(0, eq) : arg
    const key = flagNames[name]
    if (key === undefined) return Either.left(`unknown argument ${JSON.stringify(arg)}`)
    const value = eq > 0 ? arg.slice(eq + 1) : argv[++i]
    if (value === undefined) return Either.left(`${name} needs a value`)
    raw[key] = value
  }
  return Either.match(decodeFlags(raw), {
    onLeft: (error) => Either.left(ParseResult.TreeFormatter.formatErrorSync(error)),
    onRight: (flags) => Either.right({ _tag: "Run" as const, flags })
  })
}

export type RpcTarget =
  | { readonly _tag: "Auto" }
  | { readonly _tag: "Unix"; readonly path: string }
  | { readonly _tag: "Vsock"; readonly port: number }
  | { readonly _tag: "Device"; readonly path: string }

export const rpcTarget = (spec: typeof RpcSpec.Type): RpcTarget => {
  if (spec === "auto") return { _tag: "Auto" }
  if (spec.startsWith("unix:")) return { _tag: "Unix", path: spec.slice("unix:".length) }
  if (spec.startsWith("vsock:")) return { _tag: "Vsock", port: Number(spec.slice("vsock:".length)) }
  return { _tag: "Device", path: spec }
}
