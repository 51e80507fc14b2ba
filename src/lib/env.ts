import * as Config from "effect/Config"
import * as ConfigError from "effect/ConfigError"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Schema from "effect/Schema"

/**
 * abox's environment variables, read through Config (tests use ConfigProvider.fromMap), each
 * checked: a value abox does not accept is `ConfigInvalid` (exit 64), never passed on to a VMM.
 * `ABOX_HOME` is read by AboxPaths.
 */
export const qemuAccel = Config.literal(
  "auto",
  "kvm",
  "tcg"
)("ABOX_QEMU_ACCEL").pipe(Config.withDefault("auto"))
export const vmmChoice = Config.literal("qemu", "vz", "fake")("ABOX_VMM").pipe(Config.option)
export const vfkitExecutable = Config.nonEmptyString("ABOX_VFKIT").pipe(Config.withDefault("vfkit"))
export const skipScrub = Config.boolean("ABOX_SKIP_SCRUB").pipe(Config.withDefault(false))

/** an ABOX_* environment variable has a value abox does not accept */
export class ConfigInvalid extends Schema.TaggedError<ConfigInvalid>()("ConfigInvalid", {
  message: Schema.String
}) {}

/** read one of the above; a bad value becomes ConfigInvalid, in words */
export const readEnv = <A>(config: Config.Config<A>): Effect.Effect<A, ConfigInvalid> =>
  Effect.mapError(config, (error) => new ConfigInvalid({ message: describeConfigError(error) }))

const describeConfigError = (error: ConfigError.ConfigError): string =>
  ConfigError.reduceWithContext(error, undefined, {
    andCase: (_, left: string, right: string) => `${left}; ${right}`,
    orCase: (_, left: string, right: string) => `${left}; ${right}`,
    invalidDataCase: (_, path, message) => `${path.join(".")}: ${message}`,
    missingDataCase: (_, path, message) => `${path.join(".")}: ${message}`,
    sourceUnavailableCase: (_, path, message) => `${path.join(".")}: ${message}`,
    unsupportedCase: (_, path, message) => `${path.join(".")}: ${message}`
  })

/**
 * The VMM backend a host uses: the explicit choice (`ABOX_VMM=qemu|vz|fake`), else by platform
 * (vz — vfkit / Virtualization.framework — on macOS, QEMU elsewhere). `fake` runs the real guest
 * agent as a host process: a test backend, with a placeholder image (its root disk is a directory).
 */
export const chooseBackend = (
  choice: Option.Option<"qemu" | "vz" | "fake">,
  platform: NodeJS.Platform = process.platform
): "qemu" | "vz" | "fake" =>
  Option.getOrElse(choice, () => (platform === "darwin" ? ("vz" as const) : ("qemu" as const)))

/**
 * The backend and the settings it reads, each checked (ConfigInvalid): what the VMM layer is
 * made from (src/layers/Lifecycle.ts), and what every command checks before it runs, even one
 * that never starts a VM (src/layers/Base.ts).
 */
export const backendEnv: Effect.Effect<
  | { readonly backend: "fake" }
  | { readonly backend: "qemu"; readonly accel: "auto" | "kvm" | "tcg" }
  | { readonly backend: "vz"; readonly vfkit: string },
  ConfigInvalid
> = Effect.gen(function* () {
  const backend = chooseBackend(yield* readEnv(vmmChoice))
  if (backend === "qemu") return { backend, accel: yield* readEnv(qemuAccel) }
  if (backend === "vz") return { backend, vfkit: yield* readEnv(vfkitExecutable) }
  return { backend }
})
