/**
 * Reading an OCI image as `abox image import` takes it: an OCI layout directory (image-spec
 * image-layout.md: `oci-layout`, `index.json`, `blobs/<alg>/<hex>`), the same as a tar
 * (`oci-archive`, which the caller unpacks first with the checked tar reader), or a `docker save`
 * archive (`manifest.json` naming a config and layer tars). Every byte is the archive author's:
 * - a file is read only through a path that stays inside the directory once its links are
 *   resolved, and only a regular file;
 * - a JSON document is bounded (MAX_JSON_BYTES) and decoded by Schema;
 * - a blob's size and sha256 must be what its descriptor says (checked here, before any layer is
 *   applied); a layer's uncompressed digest must be its config's `diff_id` (checked as it is
 *   applied, src/lib/oci/rootfs.ts);
 * - only sha256 digests are taken.
 */
import * as Effect from "effect/Effect"
import * as ParseResult from "effect/ParseResult"
import * as Schema from "effect/Schema"
import * as fs from "node:fs/promises"
import * as path from "node:path"
import { type GuestArch } from "../../domain/session.js"
import { ImageImportRefused } from "../../domain/image.js"
import { errorMessage } from "../../domain/errorMessage.js"
import { sha256File } from "../images.js"

/** index.json, a manifest, a config or manifest.json larger than this is refused */
export const MAX_JSON_BYTES = 4 * 1024 * 1024

export type ArchiveFormat = "oci-archive" | "oci-layout" | "docker-archive"

const DIGEST = /^sha256:([0-9a-f]{64})$/

const Descriptor = Schema.Struct({
  mediaType: Schema.optional(Schema.String),
  digest: Schema.String,
  size: Schema.Number,
  annotations: Schema.optional(Schema.Record({ key: Schema.String, value: Schema.String })),
  platform: Schema.optional(
    Schema.Struct({ architecture: Schema.optional(Schema.String), os: Schema.optional(Schema.String) })
  )
})
type Descriptor = typeof Descriptor.Type

const Index = Schema.Struct({
  mediaType: Schema.optional(Schema.String),
  manifests: Schema.Array(Descriptor)
})

const Manifest = Schema.Struct({
  mediaType: Schema.optional(Schema.String),
  config: Descriptor,
  layers: Schema.Array(Descriptor)
})

export const ImageConfig = Schema.Struct({
  architecture: Schema.optional(Schema.String),
  os: Schema.optional(Schema.String),
  config: Schema.optional(
    Schema.NullOr(
      Schema.Struct({
        Env: Schema.optional(Schema.NullOr(Schema.Array(Schema.String))),
        WorkingDir: Schema.optional(Schema.NullOr(Schema.String)),
        User: Schema.optional(Schema.NullOr(Schema.String))
      })
    )
  ),
  rootfs: Schema.Struct({ type: Schema.String, diff_ids: Schema.Array(Schema.String) })
})
export type ImageConfig = typeof ImageConfig.Type

const DockerManifest = Schema.Array(
  Schema.Struct({
    Config: Schema.String,
    RepoTags: Schema.optional(Schema.NullOr(Schema.Array(Schema.String))),
    Layers: Schema.Array(Schema.String)
  })
)

export interface LayerBlob {
  readonly file: string
  /** `sha256:…` of the uncompressed tar (the config's diff_id) */
  readonly diffId: string
  readonly mediaType: string | undefined
}

export interface ImagePlan {
  readonly format: ArchiveFormat
  /** the reference the archive names (`node:20`, `docker.io/library/node:20`), if any */
  readonly reference: string | undefined
  readonly manifestDigest: string | undefined
  readonly configDigest: string
  readonly config: ImageConfig
  readonly layers: ReadonlyArray<LayerBlob>
}

export const refuse = (reason: string, message: string) => new ImageImportRefused({ reason, message })

const OCI_ARCH: Record<GuestArch, string> = { x86_64: "amd64", aarch64: "arm64" }

/** a path inside `dir` (its links resolved) naming a regular file, or a refusal */
export const insideFile = (dir: string, rel: string) =>
  Effect.gen(function* () {
    const parts = rel.split("/")
    if (rel.startsWith("/") || parts.includes("..") || rel.includes("\0"))
      return yield* refuse("path", `${JSON.stringify(rel)} is not a path inside the archive`)
    const real = yield* Effect.tryPromise({
      try: async () => [await fs.realpath(dir), await fs.realpath(path.join(dir, rel))] as const,
      catch: (cause) => refuse("missing", `the archive has no ${JSON.stringify(rel)}: ${errorMessage(cause)}`)
    })
    if (!real[1].startsWith(real[0] + path.sep))
      return yield* refuse("link", `${JSON.stringify(rel)} leads outside the archive`)
    const stat = yield* Effect.tryPromise({
      try: () => fs.lstat(real[1]),
      catch: (cause) => refuse("missing", `${JSON.stringify(rel)}: ${errorMessage(cause)}`)
    })
    if (!stat.isFile()) return yield* refuse("type", `${JSON.stringify(rel)} is not a regular file`)
    return { file: real[1], size: stat.size }
  })

const readJson = <A, I>(dir: string, rel: string, schema: Schema.Schema<A, I>) =>
  Effect.gen(function* () {
    const { file, size } = yield* insideFile(dir, rel)
    if (size > MAX_JSON_BYTES)
      return yield* refuse(
        "size",
        `${rel} is ${size} bytes, more than the ${MAX_JSON_BYTES} a document may be`
      )
    const text = yield* Effect.tryPromise({
      try: () => fs.readFile(file, "utf8"),
      catch: (cause) => refuse("read", `${rel}: ${errorMessage(cause)}`)
    })
    return yield* Schema.decodeUnknown(Schema.parseJson(schema))(text).pipe(
      Effect.mapError((error) =>
        refuse("schema", `${rel}: ${ParseResult.TreeFormatter.formatErrorSync(error)}`)
      )
    )
  })

/** a blob of the layout, its size and sha256 checked against its descriptor */
const blob = (dir: string, descriptor: Descriptor) =>
  Effect.gen(function* () {
    const hex = DIGEST.exec(descriptor.digest)?.[1]
    if (hex === undefined)
      return yield* refuse("digest", `digest ${JSON.stringify(descriptor.digest)} is not a sha256 digest`)
    const { file, size } = yield* insideFile(dir, `blobs/sha256/${hex}`)
    if (size !== descriptor.size)
      return yield* refuse(
        "size",
        `blob ${descriptor.digest} is ${size} bytes where its descriptor says ${descriptor.size}`
      )
    const actual = yield* sha256File(file).pipe(Effect.mapError((error) => refuse("read", error.message)))
    if (actual !== hex)
      return yield* refuse(
        "digest",
        `blob ${descriptor.digest} does not match its digest (its content is sha256:${actual})`
      )
    return file
  })

const INDEX_TYPES = [
  "application/vnd.oci.image.index.v1+json",
  "application/vnd.docker.distribution.manifest.list.v2+json"
]

const LAYER_TYPE =
  /^application\/vnd\.(oci\.image\.layer\.v1\.tar|docker\.image\.rootfs\.diff\.tar)(\.gzip|\+gzip|\+zstd)?$/

const layersOf = (
  config: ImageConfig,
  files: ReadonlyArray<{ file: string; mediaType: string | undefined }>
) =>
  Effect.gen(function* () {
    if (config.rootfs.diff_ids.length !== files.length)
      return yield* refuse(
        "manifest",
        `the config names ${config.rootfs.diff_ids.length} layers (diff_ids) where the manifest has ${files.length}`
      )
    for (const id of config.rootfs.diff_ids)
      if (!DIGEST.test(id))
        return yield* refuse("digest", `diff_id ${JSON.stringify(id)} is not a sha256 digest`)
    return files.map((layer, i): LayerBlob => ({ ...layer, diffId: config.rootfs.diff_ids[i]! }))
  })

/** an OCI layout: the manifest tagged `tag` (or the only one), for `arch` when it is an index */
const readOci = (dir: string, format: ArchiveFormat, tag: string | undefined, arch: GuestArch) =>
  Effect.gen(function* () {
    const index = yield* readJson(dir, "index.json", Index)
    const nameOf = (d: Descriptor) =>
      d.annotations?.["io.containerd.image.name"] ?? d.annotations?.["org.opencontainers.image.ref.name"]
    const tagged =
      tag === undefined
        ? index.manifests
        : index.manifests.filter((d) => {
            const name = d.annotations?.["org.opencontainers.image.ref.name"]
            const full = d.annotations?.["io.containerd.image.name"]
            return name === tag || full === tag || (full !== undefined && full.endsWith(`:${tag}`))
          })
    if (tagged.length !== 1) {
      const names = index.manifests.map((d) => nameOf(d) ?? d.digest).join(", ")
      return yield* refuse(
        "tag",
        tagged.length === 0
          ? `no manifest ${tag === undefined ? "" : `tagged ${JSON.stringify(tag)} `}in index.json (it has: ${names || "none"})`
          : `index.json has ${tagged.length} manifests: name one with --tag (${names})`
      )
    }
    let chosen = tagged[0]!
    const reference = nameOf(chosen)
    if (chosen.mediaType !== undefined && INDEX_TYPES.includes(chosen.mediaType)) {
      const nested = yield* Effect.flatMap(blob(dir, chosen), (file) =>
        readJson(path.dirname(file), path.basename(file), Index)
      )
      const forArch = nested.manifests.filter(
        (d) => d.platform?.architecture === OCI_ARCH[arch] && (d.platform.os ?? "linux") === "linux"
      )
      if (forArch.length === 0)
        return yield* refuse("platform", `the image has no linux/${OCI_ARCH[arch]} manifest`)
      chosen = forArch[0]!
    }
    const manifestFile = yield* blob(dir, chosen)
    const manifest = yield* readJson(path.dirname(manifestFile), path.basename(manifestFile), Manifest)
    const configFile = yield* blob(dir, manifest.config)
    const config = yield* readJson(path.dirname(configFile), path.basename(configFile), ImageConfig)
    const files = yield* Effect.forEach(manifest.layers, (layer) =>
      Effect.gen(function* () {
        if (layer.mediaType !== undefined && !LAYER_TYPE.test(layer.mediaType))
          return yield* refuse(
            "layer",
            `layer ${layer.digest} has the media type ${layer.mediaType}, which is not a layer abox applies`
          )
        return { file: yield* blob(dir, layer), mediaType: layer.mediaType }
      })
    )
    return {
      format,
      reference,
      manifestDigest: chosen.digest,
      configDigest: manifest.config.digest,
      config,
      layers: yield* layersOf(config, files)
    } satisfies ImagePlan
  })

/** a `docker save` archive, unpacked: manifest.json's image tagged `tag` (or the only one) */
const readDocker = (dir: string, tag: string | undefined) =>
  Effect.gen(function* () {
    const entries = yield* readJson(dir, "manifest.json", DockerManifest)
    const matching =
      tag === undefined
        ? entries
        : entries.filter((e) => (e.RepoTags ?? []).some((t) => t === tag || t.endsWith(`:${tag}`)))
    if (matching.length !== 1)
      return yield* refuse(
        "tag",
        matching.length === 0
          ? `no image ${tag === undefined ? "" : `tagged ${JSON.stringify(tag)} `}in manifest.json`
          : `manifest.json has ${matching.length} images: name one with --tag`
      )
    const entry = matching[0]!
    const configFile = yield* insideFile(dir, entry.Config)
    // the config's file is named by its digest (`<hex>.json`, or `blobs/sha256/<hex>`)
    const hex = /([0-9a-f]{64})(\.json)?$/.exec(entry.Config)?.[1]
    if (hex === undefined)
      return yield* refuse("digest", `the config ${JSON.stringify(entry.Config)} is not named by its digest`)
    const actual = yield* sha256File(configFile.file).pipe(
      Effect.mapError((error) => refuse("read", error.message))
    )
    if (actual !== hex) return yield* refuse("digest", `the config ${entry.Config} does not match its digest`)
    const config = yield* readJson(dir, entry.Config, ImageConfig)
    const files = yield* Effect.forEach(entry.Layers, (rel) =>
      Effect.map(insideFile(dir, rel), (found) => ({ file: found.file, mediaType: undefined }))
    )
    return {
      format: "docker-archive",
      reference: entry.RepoTags?.[0],
      manifestDigest: undefined,
      configDigest: `sha256:${hex}`,
      config,
      layers: yield* layersOf(config, files)
    } satisfies ImagePlan
  })

/** what `dir` (an OCI layout, or an unpacked `docker save` archive) holds, checked */
export const readImagePlan = (
  dir: string,
  options: {
    readonly format: "oci-archive" | "oci-layout"
    readonly tag: string | undefined
    readonly arch: GuestArch
  }
) =>
  Effect.gen(function* () {
    const has = (name: string) =>
      Effect.promise(() =>
        fs.lstat(path.join(dir, name)).then(
          (s) => s.isFile(),
          () => false
        )
      )
    // a docker save of Docker 25+ is an OCI layout too (with manifest.json beside): read as OCI
    if (yield* has("index.json")) return yield* readOci(dir, options.format, options.tag, options.arch)
    if (yield* has("manifest.json")) return yield* readDocker(dir, options.tag)
    return yield* refuse(
      "format",
      `${dir} is neither an OCI image (no index.json) nor a docker save archive (no manifest.json)`
    )
  })
