import * as Args from "@effect/cli/Args"
import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import type { RegisteredImage } from "../../domain/image.js"
import { formatBytes } from "../../lib/diskUsage.js"
import { escapeControl } from "../../lib/text.js"
import { envBuild, envList, envRemove } from "../../programs/environment.js"
import { allowEnvHosts, environmentOptions } from "../environmentOptions.js"
import { stepDisplay } from "../progress.js"
import { edge, notAnOption, printJson } from "../render.js"
import { json } from "./list.js"
import { bootOptions } from "./session.js"
import * as Option from "effect/Option"

const short = (digest: string) => digest.slice(0, 12)

const row = (image: RegisteredImage) => {
  const record = image.meta.environment!
  return escapeControl(
    `${image.meta.name}@${short(image.meta.digest)}  ${record.source} (${record.file})  base ${record.base.name}@${short(record.base.digest)}  ` +
      `setup ${record.setupSeconds} s, overlay ${formatBytes(record.overlayBytes)}` +
      `${record.granted.length > 0 ? `  granted ${record.granted.join(", ")}` : ""}  ${image.meta.created}`
  )
}

const rowJson = (image: RegisteredImage) => ({ ...image.meta, dir: image.dir })

const dir = notAnOption(Args.directory({ name: "dir" })).pipe(Args.withDescription("the repository"))

const build = Command.make(
  "build",
  {
    dir,
    allowEnvHosts,
    cpus: Options.integer("cpus").pipe(Options.optional, Options.withDescription("setup VM CPUs")),
    memory: Options.integer("memory").pipe(Options.optional, Options.withDescription("setup VM memory in MiB")),
    policy: Options.file("policy").pipe(
      Options.optional,
      Options.withDescription("HTTPS broker policy file (default $ABOX_HOME/broker.json, else deny all)")
    ),
    json
  },
  (args) =>
    edge({ json: args.json })(
      Effect.gen(function* () {
        const boot = yield* bootOptions(
          { model: Option.none(), agent: [], cpus: args.cpus, memory: args.memory, policy: args.policy },
          yield* stepDisplay(!args.json && process.stderr.isTTY === true)
        )
        const prepared = yield* envBuild(args.dir, boot, yield* environmentOptions(args.allowEnvHosts))
        if (args.json) yield* printJson({ image: rowJson(prepared.image), built: prepared.built })
        else if (prepared.image.meta.environment === undefined)
          yield* Console.log(
            `no setup: sessions of ${escapeControl(args.dir)} boot ${escapeControl(prepared.image.meta.name)} with the environment's env and install`
          )
        else yield* Console.log(`${prepared.built ? "built" : "up to date"} ${row(prepared.image)}`)
      }).pipe(Effect.scoped)
    )
).pipe(
  Command.withDescription(
    "build the environment image of a repository (.abox/environment.json or .devcontainer/devcontainer.json) unless it is up to date. Example: abox env build ./my-repo"
  )
)

const list = Command.make("list", { json }, (args) =>
  edge({ json: args.json, scrub: false })(
    Effect.gen(function* () {
      const images = yield* envList()
      if (args.json) yield* printJson({ environments: images.map((image) => rowJson(image)) })
      else yield* Console.log(images.length === 0 ? "no environment images" : images.map((image) => row(image)).join("\n"))
    })
  )
).pipe(Command.withDescription("list environment images. Example: abox env list --json"))

const rm = Command.make("rm", { dir: notAnOption(Args.text({ name: "dir" })), json }, (args) =>
  edge({ json: args.json, scrub: false })(
    Effect.gen(function* () {
      const removed = yield* envRemove(args.dir)
      if (args.json) yield* printJson({ removed: removed.map((image) => rowJson(image)) })
      else
        yield* Console.log(
          removed.map((image) => `removed ${escapeControl(`${image.meta.name}@${short(image.meta.digest)}`)}`).join("\n")
        )
    })
  )
).pipe(
  Command.withDescription(
    "remove the environment images built from a repository (refused while a session uses one). Example: abox env rm ./my-repo"
  )
)

export const env = Command.make("env").pipe(
  Command.withDescription("project environments: build, list, rm (docs/environments.md)"),
  Command.withSubcommands([build, list, rm])
)
