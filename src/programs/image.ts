import * as Command from "@effect/platform/Command"
import { stagingPath } from "../lib/staging.js"
import type * as CommandExecutor from "@effect/platform/CommandExecutor"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as ParseResult from "effect/ParseResult"
import { warmUsage } from "./warm.js"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"
import { existsSync } from "node:fs"
// Raw node:fs: mkdir/rm of the staging directory and one small read (decoded by Schema below).
import * as fs from "node:fs/promises"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { PROTOCOL_VERSION } from "../protocol/Messages.js"
import { kvmUsable } from "../vmm/kvm.js"
import { type ConfigInvalid, qemuAccel, readEnv } from "../lib/env.js"
import { type Accel, buildQemuArgv, minimalEnv, qemuBinary } from "../vmm/argv.js"
import { AboxPaths } from "../services/AboxPaths.js"
import { GuestArch } from "../domain/session.js"
import {
  type AgentStart,
  IMAGE_NAME,
  ImageInUse,
  ImageNotFound,
  type RegisteredImage
} from "../domain/image.js"
import { goldenOf, listImages, registerImage, removeImage, resolveImage, sha256File } from "../lib/images.js"
import { makeStandalone, standaloneKernel } from "../lib/rootDisk.js"
import { RuntimeLock } from "../services/RuntimeLock.js"
import { SessionStore, type SessionListing } from "../services/SessionStore.js"
import { IMAGE_FILES, sessionFile } from "../domain/sessionLayout.js"
import { errorMessage } from "../domain/errorMessage.js"

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
  /** `snapshot-entry`: the root holds what the first boot needs to build the agent's snapshot */
  agentStart: Schema.optional(Schema.Literal("snapshot-entry", "bundle"))
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
  /** each phase as it begins; `ready` once the image is registered */
  readonly onPhase?: ((phase: ImageBuildPhase) => Effect.Effect<void>) | undefined
}

/**
 * The phases of `abox image build`: the recipe's downloads (cached .debs and npm tarballs), its
 * build (initrd, root tree, mkfs), the first boot (the agent's snapshot), the registration.
 */
export type ImageBuildPhase = "download" | "build" | "first boot" | "register" | "ready"

/** the line a recipe writes on stderr when its downloads are done and its build begins */
const RECIPE_BUILD_MARK = "abox-phase: build"

const fail = (step: string, message: string) => new ImageBuildFailed({ step, message })
/** the accelerator a session VM gets here: ABOX_QEMU_ACCEL, else what QemuVmm's `auto` picks */
const sessionAccel = (arch: GuestArch): Effect.Effect<Accel, ConfigInvalid, CommandExecutor.CommandExecutor> =>
  Effect.flatMap(readEnv(qemuAccel), (wanted) =>
    wanted === "kvm" || wanted === "tcg"
      ? Effect.succeed(wanted)
      : Effect.map(kvmUsable(arch), (usable): Accel => (usable ? "kvm" : "tcg"))
  )

/** the first boot's bound: a TCG boot plus one `node --build-snapshot` of the agent */
const SNAPSHOT_BOOT_TIMEOUT = Duration.minutes(5)

/**
 * The image's first boot (kernel argument `abox.snapshot=build`): its init builds the agent's V8
 * startup snapshot with the image's node on the CPU model sessions get (same QEMU command line
 * as a session VM: accel, `-cpu`), writes /opt/abox/agent.blob into root.raw and powers off.
 * V8 rejects a blob built on another CPU model (its features are part of the blob's tag), so a
 * blob made on the build host would not do. Any failure (no QEMU for the arch, timeout, a
 * failed build) leaves an image that starts the plain bundle: never a failed build.
 */
const buildAgentSnapshot = (staging: string, arch: GuestArch) =>
  Effect.gen(function* () {
    // raw node:fs: a short directory for the unix sockets (a staging path can exceed their limit)
    const sockets = yield* Effect.acquireRelease(
      Effect.tryPromise({
        try: () => fs.mkdtemp(path.join(os.tmpdir(), "abox-snap-")),
        catch: (cause) => fail("first boot", `mkdtemp: ${errorMessage(cause)}`)
      }),
      (dir) => Effect.promise(() => fs.rm(dir, { recursive: true, force: true }).catch(() => undefined))
    )
    const configDisk = sessionFile(sockets, "configDisk")
    yield* Effect.tryPromise({
      try: () => fs.writeFile(configDisk, Buffer.alloc(4096)),
      catch: (cause) => fail("first boot", `${configDisk}: ${errorMessage(cause)}`)
    })
    const rpcSocket = sessionFile(sockets, "rpcSocket")
    const argv = buildQemuArgv({
      arch,
      accel: yield* sessionAccel(arch),
      kernel: path.join(staging, IMAGE_FILES.kernel),
      initrd: path.join(staging, IMAGE_FILES.initrd),
      rootDisk: path.join(staging, IMAGE_FILES.root),
      configDisk,
      rpcSocket,
      qmpSocket: sessionFile(sockets, "qmpSocket"),
      cpus: 2,
      memoryMiB: 1024,
      kernelArgs: ["abox.snapshot=build"]
      // nobody talks to the agent in this boot: QEMU listens on the RPC socket instead of dialling
    }).map((arg) => (arg.startsWith("socket,id=rpc,") ? `${arg},server=on,wait=off` : arg))
    const output = yield* Command.make(qemuBinary(arch), ...argv).pipe(
      Command.env(minimalEnv()),
      Command.stderr("inherit"),
      Command.string,
      Effect.timeout(SNAPSHOT_BOOT_TIMEOUT)
    )
    for (const line of output.split(/\r?\n/)) {
      const at = line.search(/abox-init:|agent-snapshot:/)
      if (at >= 0) process.stderr.write(`image build (first boot): ${line.slice(at).trim()}\n`)
    }
    return output.includes("abox-init: agent snapshot built") ? ("snapshot" as const) : ("bundle" as const)
  }).pipe(
    Effect.scoped,
    Effect.catchAll((error) =>
      Effect.sync(() => {
        process.stderr.write(
          `image build: no agent snapshot (the image starts the plain bundle): ${errorMessage(error)}\n`
        )
        return "bundle" as const
      })
    )
  )

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
  const cache = options.cacheDir ?? paths.homeFile("cache")
  const onPhase = options.onPhase ?? (() => Effect.void)

  const staging = stagingPath(paths.images, "build")
  yield* Effect.tryPromise({
    try: () => fs.mkdir(staging, { recursive: true, mode: 0o700 }),
    catch: (cause) => fail("staging", `mkdir ${staging}: ${errorMessage(cause)}`)
  })
  const removeStaging = Effect.tryPromise(() => fs.rm(staging, { recursive: true, force: true })).pipe(
    Effect.catchAll((error) =>
      Effect.sync(() =>
        process.stderr.write(`image build: could not remove ${staging}: ${errorMessage(error.cause)}\n`)
      )
    )
  )

  return yield* Effect.gen(function* () {
    yield* onPhase("download")
    // the recipe's stderr passes through, line by line, except its phase mark
    const exit = yield* Effect.scoped(
      Effect.gen(function* () {
        const recipeProcess = yield* Command.start(
          Command.make(
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
          ).pipe(Command.stdout("inherit"))
        )
        yield* recipeProcess.stderr.pipe(
          Stream.decodeText(),
          Stream.splitLines,
          Stream.runForEach((line) =>
            line.trim() === RECIPE_BUILD_MARK
              ? onPhase("build")
              : Effect.sync(() => process.stderr.write(`${line}\n`))
          )
        )
        return yield* recipeProcess.exitCode
      })
    ).pipe(Effect.mapError((error) => fail("recipe", `${recipe}: ${errorMessage(error)}`)))
    if (exit !== 0)
      return yield* fail("recipe", `${path.basename(recipe)} exited ${exit} (its output is above)`)
    const infoFile = path.join(staging, "build.json")
    const text = yield* Effect.tryPromise({
      try: () => fs.readFile(infoFile, "utf8"),
      catch: (cause) => fail("recipe", `${infoFile}: ${errorMessage(cause)}`)
    })
    const info = yield* decodeBuildInfo(text).pipe(
      Effect.mapError((error) =>
        fail("recipe", `${infoFile}: ${ParseResult.TreeFormatter.formatErrorSync(error)}`)
      )
    )
    yield* Effect.tryPromise({
      try: () => fs.rm(infoFile, { force: true }),
      catch: (cause) => fail("recipe", `${infoFile}: ${errorMessage(cause)}`)
    })
    const agentStart: AgentStart =
      info.agentStart === "snapshot-entry"
        ? yield* Effect.zipRight(onPhase("first boot"), buildAgentSnapshot(staging, info.arch))
        : "bundle"
    yield* onPhase("register")
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
      { makeDefault: options.makeDefault ?? true, agentStart }
    ).pipe(
      Effect.mapError((error) => fail("register", error.message)),
      Effect.tap(() => onPhase("ready"))
    )
  }).pipe(Effect.onError(() => removeStaging))
})

/** a session that needs an image: it boots the image's kernel, or its root disk backs onto the image's root.raw */
export interface ImageUser {
  readonly row: SessionListing & { readonly _tag: "Ok" }
  /** it boots its own kernel already (a standalone session, or one a crash left half made) */
  readonly ownKernel: boolean
}

/**
 * The sessions (current and legacy home) that use `image`: recorded with its digest (or, for the
 * default image, recorded with none: such a session resumes on the default), and not standalone
 * (their own kernel and initrd beside them, and a root disk that is not an overlay of it).
 */
export const imageUsers = Effect.fn("image.users")(function* (image: RegisteredImage) {
  const store = yield* SessionStore
  const users: Array<ImageUser> = []
  for (const row of yield* store.list()) {
    if (row._tag !== "Ok") continue
    const recorded = row.meta.image?.digest
    if (recorded === undefined ? !image.isDefault : recorded !== image.meta.digest) continue
    const ownKernel = (yield* standaloneKernel(row.dir)) !== undefined
    if (ownKernel && row.meta.rootDisk?.kind !== "overlay") continue
    users.push({ row, ownKernel })
  }
  return users
})

/** bytes a file occupies on disk (its allocated blocks), 0 if it cannot be read */
const allocatedBytes = (file: string) =>
  Effect.promise(() =>
    fs.stat(file).then(
      (s) => s.blocks * 512,
      () => 0
    )
  )

export interface ImageListing extends RegisteredImage {
  /** sessions that use it (`imageUsers`) */
  readonly sessions: number
  /** what its golden root.raw occupies: shared by every session whose root disk is an overlay of it */
  readonly sharedBytes: number
  /** its warm snapshots (src/programs/warm.ts) and the bytes they occupy */
  readonly warm: { readonly snapshots: number; readonly bytes: number }
}

export const imageList = Effect.fn("image.list")(function* () {
  const paths = yield* AboxPaths
  const listed = yield* listImages(paths.images)
  const images = yield* Effect.forEach(listed.images, (image) =>
    Effect.all({
      sessions: Effect.map(imageUsers(image), (users) => users.length),
      sharedBytes: allocatedBytes(goldenOf(image).rootDisk),
      warm: warmUsage(goldenOf(image))
    }).pipe(Effect.map((usage): ImageListing => ({ ...image, ...usage })))
  )
  return { ...listed, images }
})

const describeUsers = (users: ReadonlyArray<ImageUser>): string =>
  users.map((user) => user.row.meta.name ?? user.row.id).join(", ")

/**
 * `abox image rm name@digest`: refused (`ImageInUse`, with the sessions) while any session uses
 * the image, and for the default image unless `force`. With `force`, each such session is first
 * made standalone (src/lib/rootDisk.ts `makeStandalone`: its kernel and initrd copied beside it,
 * an overlay flattened, each step atomic) under its runtime lock; a running session, or one in
 * the read-only legacy home, is refused. The image goes only when no session needs it any more.
 */
export const imageRemove = Effect.fn("image.rm")(function* (
  ref: string,
  force: boolean,
  /** test hook: told between a session's standalone steps (`makeStandalone`) */
  between?: (step: "kernel" | "disk") => Effect.Effect<void>
) {
  const paths = yield* AboxPaths
  const store = yield* SessionStore
  const lock = yield* RuntimeLock
  if (!ref.includes("@")) {
    return yield* new ImageNotFound({
      ref,
      message: `name the image as name@digest (see \`abox image list\`)`
    })
  }
  const image = yield* resolveImage(paths.images, ref)
  const shown = `${image.meta.name}@${image.meta.digest.slice(0, 12)}`
  const users = yield* imageUsers(image)
  if (users.length > 0 && !force) {
    return yield* new ImageInUse({
      ref,
      sessions: users.map((user) => user.row.id),
      message: `${shown} is used by ${users.length} session${users.length === 1 ? "" : "s"} (${describeUsers(users)}); removing it would leave them unbootable. --force makes each standalone first (its disk made self-contained, its kernel and initrd copied beside it)`
    })
  }
  // environment images are overlays over their base's root.raw: the base stays while one does
  const layered = (yield* listImages(paths.images)).images.filter(
    (other) => other.meta.environment?.base.digest === image.meta.digest
  )
  if (layered.length > 0) {
    return yield* new ImageInUse({
      ref,
      message: `${shown} is the base of ${layered.length} environment image${layered.length === 1 ? "" : "s"} (${layered
        .map((other) => `${other.meta.name}@${other.meta.digest.slice(0, 12)}`)
        .join(", ")}); remove them first (abox env rm <dir>, or abox image rm)`
    })
  }
  const legacy = users.filter((user) => user.row.legacy)
  if (legacy.length > 0) {
    return yield* new ImageInUse({
      ref,
      sessions: legacy.map((user) => user.row.id),
      message: `${shown} is used by sessions in the legacy home, which abox does not write (${describeUsers(legacy)})`
    })
  }
  const golden = goldenOf(image)
  const standalone: Array<string> = []
  for (const user of users) {
    yield* Effect.scoped(
      Effect.gen(function* () {
        yield* lock.acquire(user.row).pipe(
          Effect.catchTag("SessionBusy", () =>
            Effect.fail(
              new ImageInUse({
                ref,
                sessions: [user.row.id],
                message: `${shown} is used by the running session ${describeUsers([user])}: stop it first${
                  standalone.length > 0 ? ` (made standalone already: ${standalone.join(", ")})` : ""
                }`
              })
            )
          )
        )
        const meta = yield* store.get(user.row.id)
        yield* makeStandalone(golden, user.row.dir, meta.rootDisk, between)
        if (meta.rootDisk?.format === "qcow2") {
          yield* store.update(user.row.id, (current) => ({
            ...current,
            rootDisk: { format: "qcow2", kind: "standalone", backing: image.meta.digest }
          }))
        }
      })
    )
    standalone.push(user.row.id)
  }
  const removed = yield* removeImage(paths.images, ref, force)
  return { image: removed, standalone }
})
