import * as Schema from "effect/Schema"

/**
 * A repository's environment (docs/environments.md): `.abox/environment.json`, or the subset of
 * `.devcontainer/devcontainer.json` abox reads. Both are the repository's words, so an
 * attacker's: decoded here field by field, and what they ask for (egress) is only requested.
 */

/** a variable a turn can be given: a shell name, nothing that could split an `env` line */
export const EnvName = Schema.String.pipe(
  Schema.pattern(/^[A-Za-z_][A-Za-z0-9_]{0,127}$/, {
    message: () => "an environment variable name: letters, digits and _, not starting with a digit"
  })
)

const EnvValue = Schema.String.pipe(
  Schema.maxLength(32 * 1024),
  Schema.filter((value) => !value.includes("\0") || "a value cannot hold a NUL byte")
)

export const EnvVars = Schema.Record({ key: EnvName, value: EnvValue })
export type EnvVars = typeof EnvVars.Type

const Port = Schema.Int.pipe(Schema.between(1, 65535))

/** a host name the repository asks to reach (HTTPS, port 443): no wildcard, no IP literal, no port */
export const RequestedHost = Schema.String.pipe(
  Schema.pattern(/^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z]{2,63}$/i, {
    message: () => "a host name (example.org): no wildcard, port, scheme or IP address"
  })
)

/** `.abox/environment.json` */
export const EnvironmentFile = Schema.Struct({
  /** the base image: a registered image name or name@digest (default `abox-full`) */
  base: Schema.optional(Schema.String.pipe(Schema.pattern(/^[A-Za-z0-9_-]{1,64}(@[0-9a-f]{8,64})?$/))),
  /** the setup script, a path inside the repository (default `.abox/setup.sh`), run as root once */
  setup: Schema.optional(Schema.String.pipe(Schema.minLength(1), Schema.maxLength(4096))),
  /** a shell command run as the repository user after each Open (`npm ci`) */
  install: Schema.optional(Schema.String.pipe(Schema.minLength(1), Schema.maxLength(64 * 1024))),
  /** variables for turns (and the setup) */
  env: Schema.optional(EnvVars),
  /** guest ports a detached session forwards to the same port on the host's loopback */
  forward: Schema.optional(Schema.Array(Port).pipe(Schema.maxItems(64))),
  /** hosts the repository asks to reach through the broker: requested, granted only by the user */
  allow: Schema.optional(Schema.Array(RequestedHost).pipe(Schema.maxItems(64))),
  cpus: Schema.optional(Schema.Int.pipe(Schema.between(1, 64))),
  /** MiB */
  memory: Schema.optional(Schema.Int.pipe(Schema.between(256, 1024 * 1024)))
})
export type EnvironmentFile = typeof EnvironmentFile.Type

const Command = Schema.Union(
  Schema.String,
  Schema.Array(Schema.String).pipe(Schema.minItems(1)),
  // the object form runs its commands one after the other here (devcontainers runs them in parallel)
  Schema.Record({ key: Schema.String, value: Schema.Union(Schema.String, Schema.Array(Schema.String)) })
)
export type DevcontainerCommand = typeof Command.Type

/** the fields of `devcontainer.json` abox reads; others are listed as ignored */
export const DevcontainerFile = Schema.Struct({
  image: Schema.optional(Schema.String.pipe(Schema.minLength(1), Schema.maxLength(1024))),
  onCreateCommand: Schema.optional(Command),
  postCreateCommand: Schema.optional(Command),
  containerEnv: Schema.optional(EnvVars),
  remoteEnv: Schema.optional(EnvVars),
  forwardPorts: Schema.optional(
    // "host:port" entries name another container of a compose file: not ours
    Schema.Array(Schema.Union(Port, Schema.String)).pipe(Schema.maxItems(64))
  )
})
export const DEVCONTAINER_FIELDS = [
  "image",
  "onCreateCommand",
  "postCreateCommand",
  "containerEnv",
  "remoteEnv",
  "forwardPorts",
  "name",
  "$schema"
] as const

/** the environment.json (or devcontainer.json) of a repository does not decode */
export class EnvironmentInvalid extends Schema.TaggedError<EnvironmentInvalid>()("EnvironmentInvalid", {
  path: Schema.String,
  /** the field at fault, where one is (`env.FOO`, `cpus`) */
  field: Schema.optional(Schema.String),
  message: Schema.String
}) {}

/** the setup script ended with a non-zero status (or was cut off): no image was made */
export class EnvironmentSetupFailed extends Schema.TaggedError<EnvironmentSetupFailed>()(
  "EnvironmentSetupFailed",
  {
    source: Schema.String,
    exitCode: Schema.NullOr(Schema.Number),
    signal: Schema.NullOr(Schema.String),
    /** the last lines of its output */
    logTail: Schema.String,
    message: Schema.String
  }
) {}

/** the install command ended with a non-zero status after Open: the session was not kept */
export class EnvironmentInstallFailed extends Schema.TaggedError<EnvironmentInstallFailed>()(
  "EnvironmentInstallFailed",
  {
    source: Schema.String,
    exitCode: Schema.NullOr(Schema.Number),
    logTail: Schema.String,
    message: Schema.String
  }
) {}

/** what an environment image records of where it came from (image.json `environment`) */
export const EnvironmentRecord = Schema.Struct({
  /** sha256 of the base digest, the setup script and the environment file: the image's key */
  key: Schema.String.pipe(Schema.pattern(/^[0-9a-f]{64}$/)),
  base: Schema.Struct({ name: Schema.String, digest: Schema.String }),
  /** the repository directory it was built from (informational; the key decides reuse) */
  source: Schema.String,
  /** the environment file it was built from, relative to the repository */
  file: Schema.String,
  /** the requested hosts the user granted for it (terminal consent, policy or --allow-env-hosts) */
  granted: Schema.Array(Schema.String),
  /** seconds the setup took, and the bytes its overlay holds */
  setupSeconds: Schema.Number,
  overlayBytes: Schema.Number
})
export type EnvironmentRecord = typeof EnvironmentRecord.Type
