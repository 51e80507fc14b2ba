import * as Effect from "effect/Effect"
import * as ParseResult from "effect/ParseResult"
import * as Schema from "effect/Schema"
import * as crypto from "node:crypto"
import { createReadStream } from "node:fs"
// Raw node:fs: streaming hashes, directory renames (atomic registration) and chmod of the
// registered files; readers go through Schema-decoded JSON below.
import * as fs from "node:fs/promises"
import * as path from "node:path"
import { pipeline } from "node:stream/promises"
import {
  type AgentStart,
  DefaultPointer,
  DiskError,
  type GoldenImage,
  IMAGE_FORMAT,
  type ImageIdentityFields,
  type ImageSource,
  ImageInUse,
  ImageJson,
  ImageNotFound,
  type RegisteredImage
} from "../domain/image.js"
import {
  DEFAULT_IMAGE_FILE,
  IMAGE_FILES,
  IMAGE_META_FILE,
  KERNEL_IMAGE_FILE
} from "../domain/sessionLayout.js"
import type { EnvironmentRecord } from "../domain/environment.js"
import { writeJsonAtomic } from "./atomicFile.js"
import { errorMessage } from "../domain/errorMessage.js"

/**
 * The image registry: `$ABOX_HOME/images/<name>/<digest>/{vmlinuz,initrd.gz,root.raw,image.json}`,
 * content-addressed, plus `$ABOX_HOME/images/default.json` naming the default `{name, digest}`.
 * An aarch64 image also holds `Image`, its kernel uncompressed (Virtualization.framework boots no
 * other kind), recorded as `files.kernelImage`.
 */

const io = <A>(file: string, reason: string, run: () => Promise<A>) =>
  Effect.tryPromise({
    try: run,
    catch: (cause) =>
      new DiskError({ path: file, reason, message: `${reason} ${file}: ${errorMessage(cause)}` })
  })

export const sha256File = (file: string) =>
  io(file, "hash", async () => {
    const hash = crypto.createHash("sha256")
    await pipeline(createReadStream(file, { highWaterMark: 1024 * 1024 }), hash)
    return hash.digest("hex")
  })

/** sha256 over the identity fields (fixed key order) and the three file digests */
export const imageDigest = (
  identity: ImageIdentityFields,
  files: { kernel: string; initrd: string; root: string }
) =>
  crypto
    .createHash("sha256")
    .update(
      JSON.stringify([
        identity.name,
        identity.variant,
        identity.arch,
        identity.kernel,
        identity.node,
        identity.agent,
        identity.protocol,
        files.kernel,
        files.initrd,
        files.root
      ])
    )
    .digest("hex")

const decodeImageJson = Schema.decodeUnknown(Schema.parseJson(ImageJson))
const decodeDefault = Schema.decodeUnknown(Schema.parseJson(DefaultPointer))

const readText = (file: string) =>
  Effect.tryPromise({ try: () => fs.readFile(file, "utf8"), catch: (cause) => cause }).pipe(
    Effect.catchAll((cause) =>
      typeof cause === "object" && cause !== null && "code" in cause && cause.code === "ENOENT"
        ? Effect.succeed(undefined)
        : Effect.fail(
            new DiskError({ path: file, reason: "read", message: `read ${file}: ${errorMessage(cause)}` })
          )
    )
  )

export const readDefault = (imagesDir: string) =>
  Effect.gen(function* () {
    const file = path.join(imagesDir, DEFAULT_IMAGE_FILE)
    const text = yield* readText(file)
    if (text === undefined) return undefined
    return yield* decodeDefault(text).pipe(
      Effect.mapError(
        (error) =>
          new DiskError({
            path: file,
            reason: "corrupt",
            message: `${file}: ${ParseResult.TreeFormatter.formatErrorSync(error)}`
          })
      )
    )
  })

export const writeDefault = (
  imagesDir: string,
  pointer: { readonly name: string; readonly digest: string }
) => {
  const value: DefaultPointer = { format: IMAGE_FORMAT, name: pointer.name, digest: pointer.digest }
  return writeJsonAtomic(path.join(imagesDir, DEFAULT_IMAGE_FILE), DefaultPointer, value).pipe(
    Effect.mapError((error) => new DiskError({ path: imagesDir, reason: "write", message: error.message }))
  )
}

const listDir = (dir: string) =>
  Effect.tryPromise({ try: () => fs.readdir(dir, { withFileTypes: true }), catch: (cause) => cause }).pipe(
    Effect.map((entries) =>
      entries.filter((e) => e.isDirectory() && !e.name.startsWith(".")).map((e) => e.name)
    ),
    Effect.orElseSucceed((): Array<string> => [])
  )

/**
 * Every registered image, newest first. A directory whose image.json is missing or does not
 * decode is skipped and reported in `problems` (left as it is).
 */
export const listImages = (imagesDir: string) =>
  Effect.gen(function* () {
    const pointer = yield* readDefault(imagesDir).pipe(Effect.orElseSucceed(() => undefined))
    const images: Array<RegisteredImage> = []
    const problems: Array<string> = []
    for (const name of yield* listDir(imagesDir)) {
      for (const digest of yield* listDir(path.join(imagesDir, name))) {
        const dir = path.join(imagesDir, name, digest)
        const file = path.join(dir, IMAGE_META_FILE)
        const text = yield* readText(file).pipe(Effect.orElseSucceed(() => undefined))
        if (text === undefined) {
          problems.push(`${file}: missing`)
          continue
        }
        const decoded = yield* decodeImageJson(text).pipe(Effect.either)
        if (decoded._tag === "Left") {
          problems.push(`${file}: ${ParseResult.TreeFormatter.formatErrorSync(decoded.left)}`)
          continue
        }
        const meta = decoded.right
        images.push({
          dir,
          meta,
          isDefault: pointer !== undefined && pointer.name === meta.name && pointer.digest === meta.digest
        })
      }
    }
    images.sort((a, b) => b.meta.created.localeCompare(a.meta.created))
    return { images, problems, defaultPointer: pointer }
  })

/** `undefined` → the default; `name` → the default if it has that name, else that name's newest; `name@digest` (a digest prefix of ≥ 8 works) */
export const resolveImage = (imagesDir: string, ref: string | undefined) =>
  Effect.gen(function* () {
    const { images, defaultPointer } = yield* listImages(imagesDir)
    const shown = ref ?? "default"
    const notFound = (message: string) => new ImageNotFound({ ref: shown, message })
    if (ref === undefined) {
      if (defaultPointer === undefined) {
        return yield* notFound("no default image: build one with `abox image build` (or `make image-update`)")
      }
      const found = images.find((i) => i.isDefault)
      if (found === undefined) {
        return yield* notFound(
          `the default image ${defaultPointer.name}@${defaultPointer.digest.slice(0, 12)} is not registered any more`
        )
      }
      return found
    }
    const at = ref.indexOf("@")
    const name = at === -1 ? ref : ref.slice(0, at)
    const digest = at === -1 ? undefined : ref.slice(at + 1)
    if (digest !== undefined && digest.length < 8)
      return yield* notFound(`digest prefix "${digest}" is too short (8 or more)`)
    const candidates = images.filter(
      (i) => i.meta.name === name && (digest === undefined || i.meta.digest.startsWith(digest))
    )
    if (candidates.length === 0) return yield* notFound(`no image ${ref} (see \`abox image list\`)`)
    if (digest !== undefined && candidates.length > 1)
      return yield* notFound(`digest prefix of ${ref} is ambiguous`)
    return candidates.find((i) => i.isDefault) ?? candidates[0]!
  })

export const goldenOf = (image: RegisteredImage): GoldenImage => ({
  identity: {
    name: image.meta.name,
    digest: image.meta.digest,
    kernel: image.meta.kernel,
    node: image.meta.node,
    agent: image.meta.agent
  },
  arch: image.meta.arch,
  protocol: image.meta.protocol,
  kernel: path.join(image.dir, image.meta.files.kernel.file),
  initrd: path.join(image.dir, image.meta.files.initrd.file),
  rootDisk: path.join(image.dir, image.meta.files.root.file),
  ...(image.meta.files.root.file.endsWith(".qcow2") ? { rootFormat: "qcow2" as const } : {})
})

/**
 * Register a built image: `staging` holds vmlinuz, initrd.gz and root.raw and lies inside
 * `imagesDir` (same filesystem). Hashes the files, writes image.json, then renames the
 * directory to `<name>/<digest>` in one step: a reader sees the whole image or none of it.
 */
export const registerImage = Effect.fn("images.register")(function* (
  imagesDir: string,
  staging: string,
  identity: ImageIdentityFields,
  options: {
    readonly makeDefault: boolean
    readonly agentStart?: AgentStart | undefined
    readonly source?: ImageSource | undefined
    /** the root's file name in `staging` (default root.raw; an environment image's is root.qcow2) */
    readonly rootFile?: string | undefined
    readonly environment?: EnvironmentRecord | undefined
  }
) {
  const rootFile = options.rootFile ?? IMAGE_FILES.root
  const hashOf = (file: string) =>
    Effect.all({
      sha256: sha256File(path.join(staging, file)),
      stat: io(file, "stat", () => fs.stat(path.join(staging, file)))
    })
  const [kernel, initrd, root] = yield* Effect.all(
    [hashOf(IMAGE_FILES.kernel), hashOf(IMAGE_FILES.initrd), hashOf(rootFile)],
    { concurrency: 3 }
  )
  const shipsKernelImage = yield* io(KERNEL_IMAGE_FILE, "stat", () =>
    fs.stat(path.join(staging, KERNEL_IMAGE_FILE)).then(
      () => true,
      () => false
    )
  )
  const kernelImage = shipsKernelImage ? yield* hashOf(KERNEL_IMAGE_FILE) : undefined
  const digest = imageDigest(identity, { kernel: kernel.sha256, initrd: initrd.sha256, root: root.sha256 })
  const meta: ImageJson = {
    format: IMAGE_FORMAT,
    ...identity,
    digest,
    created: new Date().toISOString(),
    files: {
      kernel: { file: IMAGE_FILES.kernel, sha256: kernel.sha256, size: kernel.stat.size },
      initrd: { file: IMAGE_FILES.initrd, sha256: initrd.sha256, size: initrd.stat.size },
      root: { file: rootFile, sha256: root.sha256, size: root.stat.size },
      ...(kernelImage === undefined
        ? {}
        : {
            kernelImage: {
              file: KERNEL_IMAGE_FILE,
              sha256: kernelImage.sha256,
              size: kernelImage.stat.size
            }
          })
    },
    ...(options.agentStart === undefined ? {} : { agentStart: options.agentStart }),
    ...(options.source === undefined ? {} : { source: options.source }),
    ...(options.environment === undefined ? {} : { environment: options.environment })
  }
  // golden files are read-only: sessions clone them, nothing writes them
  for (const file of [
    IMAGE_FILES.kernel,
    IMAGE_FILES.initrd,
    rootFile,
    ...(kernelImage === undefined ? [] : [KERNEL_IMAGE_FILE])
  ]) {
    yield* io(file, "chmod", () => fs.chmod(path.join(staging, file), 0o444))
  }
  yield* writeJsonAtomic(path.join(staging, IMAGE_META_FILE), ImageJson, meta, 0o444).pipe(
    Effect.mapError((error) => new DiskError({ path: staging, reason: "write", message: error.message }))
  )
  const parent = path.join(imagesDir, identity.name)
  const target = path.join(parent, digest)
  yield* io(parent, "mkdir", () => fs.mkdir(parent, { recursive: true, mode: 0o700 }))
  const exists = yield* io(target, "stat", () =>
    fs.stat(target).then(
      () => true,
      () => false
    )
  )
  if (exists) {
    yield* io(staging, "remove", () => fs.rm(staging, { recursive: true, force: true }))
  } else {
    yield* io(target, "rename", () => fs.rename(staging, target))
  }
  if (options.makeDefault) yield* writeDefault(imagesDir, { name: identity.name, digest })
  return { dir: target, meta, isDefault: options.makeDefault } satisfies RegisteredImage
})

/**
 * A reference as docker and skopeo complete it: `node:20` → `docker.io/library/node:20`,
 * `ghcr.io/o/r` → `ghcr.io/o/r:latest` (a digest reference `…@sha256:…` keeps its digest).
 */
export const normalizeReference = (reference: string): string => {
  const slash = reference.indexOf("/")
  const first = slash === -1 ? "" : reference.slice(0, slash)
  const hasDomain = first !== "" && (first.includes(".") || first.includes(":") || first === "localhost")
  const domain = hasDomain ? first : "docker.io"
  let rest = hasDomain ? reference.slice(slash + 1) : reference
  if (domain === "docker.io" && !rest.includes("/")) rest = `library/${rest}`
  const lastPart = rest.slice(rest.lastIndexOf("/") + 1)
  if (!rest.includes("@") && !lastPart.includes(":")) rest = `${rest}:latest`
  return `${domain}/${rest}`
}

/**
 * The newest image imported from `reference` (`abox image import`; compared normalised, so
 * `node:20` finds `docker.io/library/node:20`), or undefined.
 */
export const findImportedImage = (imagesDir: string, reference: string) =>
  Effect.map(listImages(imagesDir), ({ images }) => {
    const wanted = normalizeReference(reference)
    return images.find(
      (image) =>
        image.meta.source?.reference !== undefined && normalizeReference(image.meta.source.reference) === wanted
    )
  })

/**
 * remove `name@digest`; refuses the default unless `force` (then the pointer goes too). Sessions
 * are never touched here: `abox image rm` (src/programs/image.ts) refuses, or makes the sessions
 * that use the image standalone, first.
 */
export const removeImage = Effect.fn("images.remove")(function* (
  imagesDir: string,
  ref: string,
  force: boolean
) {
  if (!ref.includes("@")) {
    return yield* new ImageNotFound({
      ref,
      message: `name the image as name@digest (see \`abox image list\`)`
    })
  }
  const image = yield* resolveImage(imagesDir, ref)
  if (image.isDefault && !force) {
    return yield* new ImageInUse({
      ref,
      message: `${image.meta.name}@${image.meta.digest.slice(0, 12)} is the default image; pass --force to remove it anyway`
    })
  }
  // rename away first (atomic: readers never see half an image), then delete
  const trash = path.join(imagesDir, `.rm-${image.meta.digest}-${crypto.randomBytes(4).toString("hex")}`)
  yield* io(image.dir, "rename", () => fs.rename(image.dir, trash))
  if (image.isDefault)
    yield* io(path.join(imagesDir, DEFAULT_IMAGE_FILE), "remove", () =>
      fs.rm(path.join(imagesDir, DEFAULT_IMAGE_FILE), { force: true })
    )
  yield* io(trash, "remove", () => fs.rm(trash, { recursive: true, force: true }))
  const parent = path.dirname(image.dir)
  yield* io(parent, "rmdir", () => fs.rmdir(parent).catch(() => undefined))
  return image
})
