import * as Args from "@effect/cli/Args"
import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import { hostArch } from "../../lib/arch.js"
import type { RegisteredImage } from "../../domain/image.js"
import { formatBytes } from "../../lib/diskUsage.js"
import {
  buildImage,
  type ImageBuildPhase,
  type ImageListing,
  imageList,
  imageRemove
} from "../../programs/image.js"
import { importImage, parseSize } from "../../programs/imageImport.js"
import { DEFAULT_IMPORT_LIMITS } from "../../lib/oci/rootfs.js"
import { ImageImportRefused } from "../../domain/image.js"
import { stepDisplay } from "../progress.js"
import { warmImage } from "../../programs/warm.js"
import { DEFAULT_CPUS, DEFAULT_MEMORY_MIB } from "../../programs/session.js"
import { edge, notAnOption, printJson } from "../render.js"
import { escapeControl } from "../../lib/text.js"

const json = Options.boolean("json").pipe(Options.withDescription("print JSON on stdout"))

const short = (digest: string) => digest.slice(0, 12)

/** one image in a line, its control characters escaped (the registry's files are only as sound as the disk) */
const row = (image: RegisteredImage) =>
  escapeControl(
    `${image.meta.name}@${short(image.meta.digest)}${image.isDefault ? " (default)" : ""}  ${image.meta.variant} ${image.meta.arch}  ` +
      `kernel ${image.meta.kernel}  node ${image.meta.node}  agent ${short(image.meta.agent)}  protocol ${image.meta.protocol}  ${image.meta.created}`
  )

/** `abox image list`: how many sessions use the image, the golden's bytes they share, its warm snapshot */
const usageOf = (image: ImageListing) =>
  `  ${image.sessions} session${image.sessions === 1 ? "" : "s"}, ${formatBytes(image.sharedBytes)} shared, ` +
  (image.warm.snapshots === 0
    ? "no warm snapshot"
    : `${image.warm.snapshots} warm snapshot${image.warm.snapshots === 1 ? "" : "s"} (${formatBytes(image.warm.bytes)})`)

const rowJson = (image: RegisteredImage) => ({ ...image.meta, dir: image.dir, default: image.isDefault })

const build = Command.make(
  "build",
  {
    arch: Options.choice("arch", ["x86_64", "aarch64"]).pipe(
      Options.withDefault(hostArch()),
      Options.withDescription("guest architecture")
    ),
    variant: Options.choice("variant", ["small", "full"]).pipe(
      Options.withDefault("small" as const),
      Options.withDescription(
        "small: busybox + node (default); full: the workstation (Debian: bash, git, curl, wget, make, gcc, python3, Node 24 with npm, …), what scripts/setup.sh builds"
      )
    ),
    name: Options.text("name").pipe(
      Options.optional,
      Options.withDescription("image name (default abox / abox-full)")
    ),
    agent: Options.file("agent").pipe(
      Options.optional,
      Options.withDescription("guest-agent bundle (default dist/abox-guest.js next to the CLI)")
    ),
    noDefault: Options.boolean("no-default").pipe(
      Options.withDescription("register without making it the default")
    ),
    json
  },
  (args) =>
    edge({ json: args.json, scrub: false })(
      Effect.gen(function* () {
        // the running phase with its elapsed time (live on a terminal, plain lines otherwise)
        const onPhase = yield* stepDisplay<ImageBuildPhase>(!args.json)
        const image = yield* buildImage({
          arch: args.arch,
          variant: args.variant,
          name: Option.getOrUndefined(args.name),
          agent: Option.getOrUndefined(args.agent),
          makeDefault: !args.noDefault,
          onPhase
        })
        if (args.json) yield* printJson({ image: rowJson(image) })
        else yield* Console.log(`registered ${row(image)}\n  ${escapeControl(image.dir)}`)
      }).pipe(Effect.scoped, Effect.provide(NodeCommandExecutor.layer))
    )
).pipe(
  Command.withDescription(
    "build a golden image from Debian packages and the npm registry, and register it. Example: abox image build --variant full"
  )
)

const list = Command.make("list", { json }, (args) =>
  edge({ json: args.json, scrub: false })(
    Effect.gen(function* () {
      const { images, problems } = yield* imageList()
      if (args.json) {
        yield* printJson({
          images: images.map((image) => ({
            ...rowJson(image),
            sessions: image.sessions,
            sharedBytes: image.sharedBytes,
            warm: image.warm
          })),
          problems
        })
        return
      }
      yield* Console.log(
        images.length === 0
          ? "no images (abox image build)"
          : images.map((image) => row(image) + usageOf(image)).join("\n")
      )
      for (const problem of problems) yield* Console.error(`abox: skipped ${escapeControl(problem)}`)
    })
  )
).pipe(Command.withDescription("list registered golden images. Example: abox image list --json"))

const rm = Command.make(
  "rm",
  {
    ref: notAnOption(Args.text({ name: "name@digest" })).pipe(
      Args.withDescription("the image (a digest prefix of 8+ works)")
    ),
    force: Options.boolean("force").pipe(
      Options.withDescription(
        "remove even the default image, or one that sessions use: each is made standalone first (its disk self-contained, its kernel and initrd kept with it)"
      )
    ),
    json
  },
  (args) =>
    edge({ json: args.json, scrub: false })(
      Effect.gen(function* () {
        const { image, standalone } = yield* imageRemove(args.ref, args.force)
        if (args.json) yield* printJson({ removed: [rowJson(image)], standalone })
        else
          yield* Console.log(
            standalone.length === 0
              ? `removed ${escapeControl(`${image.meta.name}@${short(image.meta.digest)}`)} (no session used it)`
              : `made ${standalone.length} session${standalone.length === 1 ? "" : "s"} standalone (${escapeControl(standalone.join(", "))}); removed ${escapeControl(`${image.meta.name}@${short(image.meta.digest)}`)}`
          )
      })
    )
).pipe(
  Command.withDescription(
    "remove a golden image (never a session): refused while sessions use it, unless --force. Example: abox image rm abox@3f2a…"
  )
)

const importCommand = Command.make(
  "import",
  {
    source: notAnOption(Args.text({ name: "archive|dir[:tag]" })).pipe(
      Args.withDescription(
        "an oci-archive or `docker save` tar (gzip too), or an OCI layout directory (dir:tag names its tag)"
      )
    ),
    name: Options.text("name").pipe(
      Options.optional,
      Options.withDescription("image name (default: the reference's last part, e.g. node)")
    ),
    tag: Options.text("tag").pipe(
      Options.optional,
      Options.withDescription("the manifest (OCI index) or image (docker save) of that tag")
    ),
    reference: Options.text("reference").pipe(
      Options.optional,
      Options.withDescription(
        "the reference to record (e.g. docker.io/library/node:20): default, the archive's own"
      )
    ),
    base: Options.text("base").pipe(
      Options.optional,
      Options.withDescription(
        "the small abox image whose kernel, initrd, agent and runtime it gets (default abox)"
      )
    ),
    maxSize: Options.text("max-size").pipe(
      Options.optional,
      Options.withDescription("refuse an image whose files take more than this (default 16G; K, M, G, T)")
    ),
    json
  },
  (args) =>
    edge({ json: args.json, scrub: false })(
      Effect.gen(function* () {
        const maxSize = Option.getOrUndefined(args.maxSize)
        const maxBytes = maxSize === undefined ? DEFAULT_IMPORT_LIMITS.maxBytes : parseSize(maxSize)
        if (maxBytes === undefined)
          return yield* new ImageImportRefused({
            reason: "limit",
            message: `--max-size ${JSON.stringify(maxSize)}: a size such as 16G, 512M or a number of bytes`
          })
        const image = yield* importImage({
          source: args.source,
          name: Option.getOrUndefined(args.name),
          tag: Option.getOrUndefined(args.tag),
          reference: Option.getOrUndefined(args.reference),
          base: Option.getOrUndefined(args.base),
          limits: { ...DEFAULT_IMPORT_LIMITS, maxBytes }
        })
        if (args.json) yield* printJson({ image: rowJson(image) })
        else
          yield* Console.log(
            `imported ${row(image)}\n  ${escapeControl(image.meta.source?.reference ?? "(no reference)")}\n  ${escapeControl(image.dir)}`
          )
      })
    )
).pipe(
  Command.withDescription(
    "import an OCI image (skopeo copy … oci-archive:x.tar, or docker save -o x.tar) as a golden image. Example: abox image import node.tar --name node"
  )
)

const warm = Command.make(
  "warm",
  {
    ref: notAnOption(Args.text({ name: "name[@digest]" })).pipe(
      Args.withDescription("the image (default: the default image)"),
      Args.optional
    ),
    json
  },
  (args) =>
    edge({ json: args.json, scrub: false })(
      Effect.gen(function* () {
        const made = yield* warmImage(Option.getOrUndefined(args.ref), {
          cpus: DEFAULT_CPUS,
          memoryMiB: DEFAULT_MEMORY_MIB
        })
        const shown = escapeControl(`${made.image.identity.name}@${short(made.image.identity.digest)}`)
        if (args.json) yield* printJson({ image: made.image.identity, dir: made.dir, made: made.built })
        else
          yield* Console.log(
            `${shown}: warm snapshot ${made.built ? "made" : "already there"} (${escapeControl(made.dir)})`
          )
      })
    )
).pipe(
  Command.withDescription(
    "make the image's warm snapshot now (Open makes it lazily otherwise; ABOX_WARM=0 turns warm open off). Example: abox image warm"
  )
)

export const image = Command.make("image").pipe(
  Command.withDescription("golden images: build, import, list, rm, warm"),
  Command.withSubcommands([build, importCommand, list, rm, warm])
)
