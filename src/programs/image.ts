import * as Command from "@effect/platform/Command"
import * as Effect from "effect/Effect"
import * as ParseResult from "effect/ParseResult"
import * as Schema from "effect/Schema"
import * as crypto from "node:crypto"
import { existsSync } from "node:fs"
// Raw node:fs: mkdir/rm of the staging directory and one small read (decoded by Schema below).
import * as fs from "node:fs/promises"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { PROTOCOL_VERSION } from "../protocol/Messages.js"
import { AboxPaths } from "../services/AboxPaths.js"
import { GuestArch } from "../services/SessionStore.js"
import { AgentStart, IMAGE_NAME, listImages, registerImage, removeImage, sha256File } from "../lib/images.js"

/** `abox image build` could not build (a recipe step failed, an input is missing) */
export class ImageBuildFailed extends Schema.TaggedError<ImageBuildFailed>()("ImageBuildFailed", {
  step: Schema.String,
  message: Schema.String
}) {}

export const ImageVariant = Schema.Literal("small", "full")
export type ImageVariant = typeof ImageVariant.Type

/** what a recipe script reports in `<out>/build.json` */
const BuildInfo = Schema.Struct({
  variant: ImageVariant,
  arch: GuestArch,
  kernel: Schema.String,
  node: Schema.String,
  agentStart: Schema.optional(AgentStart)
})
const decodeBuildInfo = Schema.decodeUnknown(Schema.parseJson(BuildInfo))

/**
 * The package root (holds package.json, images/ and dist/): found by walking up from this
 * module, which is dist/abox.js when bundled and src/programs/image.ts under tsx.
 */
export const packageRoot = (): string => {
  let dir = path.dirname(fileURLToPath(import.meta.url))
  for (let i = 0; i < 6; i++) {
    if (existsSync(path.join(dir, "package.json")) && existsSync(path.join(dir, "images"))) return dir
    dir = path.dirname(dir)
  }
  return process.cwd()
}

export interface BuildOptions {
  readonly arch: GuestArch
  readonly variant: ImageVariant
  readonly name?: string | undefined
  /** the guest-agent bundle; default `<package>/dist/abox-guest.js` */
  readonly agent?: string | undefined
  /**
   * the agent's startup-snapshot entry (CommonJS); default `abox-guest-snapshot.cjs` next to the
   * bundle when present. Without it (or when the guest's node cannot run on this host) the image
   * starts the plain bundle.
   */
  readonly snapshotEntry?: string | undefined
  /** make it the default image (default true) */
  readonly makeDefault?: boolean | undefined
  /** download cache; default `$ABOX_HOME/cache` */
  readonly cacheDir?: string | undefined
}

const fail = (step: string, message: string) => new ImageBuildFailed({ step, message })
const reasonOf = (cause: unknown): string => (cause instanceof Error ? cause.message : String(cause))

/**
 * Build and register a golden image: run `images/build-<variant>.sh` into a staging directory
 * inside `$ABOX_HOME/images` (same filesystem), then register it content-addressed in one
 * rename. A failure removes the staging directory; registered images are never touched.
 */
export const buildImage = Effect.fn("image.build")(function* (options: BuildOptions) {
  const paths = yield* AboxPaths
  const root = packageRoot()
  const name = options.name ?? (options.variant === "small" ? "abox" : "abox-full")
  if (!IMAGE_NAME.test(name))
    return yield* fail("name", `image name "${name}" must match [A-Za-z0-9_-]{1,64}`)
  const agent = path.resolve(options.agent ?? path.join(root, "dist", "abox-guest.js"))
  if (!existsSync(agent))
    return yield* fail("agent", `guest-agent bundle ${agent} not found: run \`npm run build\` first`)
  const snapshotEntry = path.resolve(
    options.snapshotEntry ?? path.join(path.dirname(agent), "abox-guest-snapshot.cjs")
  )
  const recipe = path.join(root, "images", `build-${options.variant}.sh`)
  if (!existsSync(recipe)) return yield* fail("recipe", `recipe ${recipe} not found`)
  const cache = options.cacheDir ?? path.join(paths.home, "cache")

  const staging = path.join(paths.images, `.build-${crypto.randomBytes(6).toString("hex")}`)
  yield* Effect.tryPromise({
    try: () => fs.mkdir(staging, { recursive: true, mode: 0o700 }),
    catch: (cause) => fail("staging", `mkdir ${staging}: ${reasonOf(cause)}`)
  })
  const removeStaging = Effect.promise(() => fs.rm(staging, { recursive: true, force: true }))

  return yield* Effect.gen(function* () {
    const exit = yield* Command.make(
      "sh",
      recipe,
      "--arch",
      options.arch,
      "--out",
      staging,
      "--cache",
      cache,
      "--agent",
      agent,
      ...(existsSync(snapshotEntry) ? ["--snapshot-entry", snapshotEntry] : [])
    ).pipe(
      Command.stdout("inherit"),
      Command.stderr("inherit"),
      Command.exitCode,
      Effect.mapError((error) => fail("recipe", `${recipe}: ${reasonOf(error)}`))
    )
    if (exit !== 0)
      return yield* fail("recipe", `${path.basename(recipe)} exited ${exit} (its output is above)`)
    const infoFile = path.join(staging, "build.json")
    const text = yield* Effect.tryPromise({
      try: () => fs.readFile(infoFile, "utf8"),
      catch: (cause) => fail("recipe", `${infoFile}: ${reasonOf(cause)}`)
    })
    const info = yield* decodeBuildInfo(text).pipe(
      Effect.mapError((error) =>
        fail("recipe", `${infoFile}: ${ParseResult.TreeFormatter.formatErrorSync(error)}`)
      )
    )
    yield* Effect.promise(() => fs.rm(infoFile, { force: true }))
    const agentDigest = yield* sha256File(agent).pipe(
      Effect.mapError((error) => fail("agent", error.message))
    )
    return yield* registerImage(
      paths.images,
      staging,
      {
        name,
        variant: info.variant,
        arch: info.arch,
        kernel: info.kernel,
        node: info.node,
        agent: agentDigest,
        protocol: PROTOCOL_VERSION
      },
      { makeDefault: options.makeDefault ?? true, agentStart: info.agentStart }
    ).pipe(Effect.mapError((error) => fail("register", error.message)))
  }).pipe(Effect.onError(() => removeStaging))
})

export const imageList = Effect.fn("image.list")(function* () {
  const paths = yield* AboxPaths
  return yield* listImages(paths.images)
})

export const imageRemove = Effect.fn("image.rm")(function* (ref: string, force: boolean) {
  const paths = yield* AboxPaths
  return yield* removeImage(paths.images, ref, force)
})
