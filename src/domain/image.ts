import * as Schema from "effect/Schema"
import { EnvironmentRecord } from "./environment.js"
import { GuestArch, type ImageIdentity } from "./session.js"

/**
 * The image registry's records (docs/on-disk.md "Images"): `images/<name>/<digest>/image.json`
 * and `images/default.json`, and what a registered image gives Open.
 */
export const IMAGE_FORMAT = 1

const Sha256 = Schema.String.pipe(Schema.pattern(/^[0-9a-f]{64}$/))

export const ImageFile = Schema.Struct({ file: Schema.String, sha256: Sha256, size: Schema.Number })

/** the identity fields: with the three file digests they make the image's digest */
export const ImageIdentityFields = Schema.Struct({
  name: Schema.String,
  /** `oci`: imported from an OCI image (`abox image import`), its `source` says which */
  variant: Schema.Literal("small", "full", "oci"),
  arch: GuestArch,
  kernel: Schema.String,
  node: Schema.String,
  /** sha256 of the guest-agent bundle baked in at /opt/abox/abox-guest.js */
  agent: Sha256,
  protocol: Schema.Number
})
export type ImageIdentityFields = typeof ImageIdentityFields.Type

/**
 * how the image's init starts the agent: from a V8 startup snapshot (falling back to the bundle
 * if node rejects it) or from the plain bundle; recorded, not part of the identity (root.raw's
 * digest covers the blob)
 */
export const AgentStart = Schema.Literal("snapshot", "bundle")
export type AgentStart = typeof AgentStart.Type

/** an imported image's Env for turns, in its root (written by `abox image import`, read by the guest agent) */
export const IMAGE_ENV_FILE = "/opt/abox/image-env.json"

/** where an imported image came from (`abox image import`, docs/images.md) */
export const ImageSource = Schema.Struct({
  kind: Schema.Literal("oci"),
  format: Schema.Literal("oci-archive", "oci-layout", "docker-archive"),
  /** the image's reference, normalised (`docker.io/library/node:20`), when the archive names one */
  reference: Schema.optional(Schema.String),
  /** the digests of its manifest (absent for a `docker save` archive, which has none) and config */
  manifest: Schema.optional(Schema.String),
  config: Schema.String,
  layers: Schema.Number,
  /** its config's Env (given to turns), WorkingDir and User */
  env: Schema.Array(Schema.String),
  workingDir: Schema.optional(Schema.String),
  user: Schema.optional(Schema.String),
  /** the abox image whose kernel, initrd, agent and runtime it carries (`name@digest`) */
  base: Schema.String
})
export type ImageSource = typeof ImageSource.Type

export const ImageJson = Schema.Struct({
  format: Schema.Literal(IMAGE_FORMAT),
  ...ImageIdentityFields.fields,
  digest: Sha256,
  created: Schema.String,
  files: Schema.Struct({
    kernel: ImageFile,
    initrd: ImageFile,
    root: ImageFile,
    /**
     * `vmlinuz` uncompressed, when the recipe ships it (aarch64): not part of the digest, which
     * `vmlinuz` already determines; images built before it existed have none
     */
    kernelImage: Schema.optional(ImageFile)
  }),
  agentStart: Schema.optional(AgentStart),
  /**
   * an environment image (docs/environments.md): its root (`files.root`, `root.qcow2`) is a qcow2
   * overlay over the base image's root.raw, which it names here
   */
  environment: Schema.optional(EnvironmentRecord),
  source: Schema.optional(ImageSource)
})
export type ImageJson = typeof ImageJson.Type

export const DefaultPointer = Schema.Struct({
  format: Schema.Literal(IMAGE_FORMAT),
  name: Schema.String,
  digest: Sha256
})
export type DefaultPointer = typeof DefaultPointer.Type

/** image names become directory names: the same rule as session names */
export const IMAGE_NAME = /^[A-Za-z0-9_-]{1,64}$/

export interface RegisteredImage {
  readonly dir: string
  readonly meta: ImageJson
  readonly isDefault: boolean
}

/** A registered golden image, ready to clone and boot. */
export interface GoldenImage {
  readonly identity: ImageIdentity
  readonly arch: GuestArch
  readonly protocol: number
  readonly kernel: string
  readonly initrd: string
  readonly rootDisk: string
  /** the golden root's format: raw (absent), or qcow2 for an environment image's overlay */
  readonly rootFormat?: "raw" | "qcow2" | undefined
}

export class ImageNotFound extends Schema.TaggedError<ImageNotFound>()("ImageNotFound", {
  ref: Schema.String,
  message: Schema.String
}) {}

export class DiskError extends Schema.TaggedError<DiskError>()("DiskError", {
  path: Schema.String,
  reason: Schema.String,
  message: Schema.String,
  /** what failed underneath (a tool's start, a file system call), kept for diagnosis */
  cause: Schema.optional(Schema.Defect)
}) {}

export class ImageInUse extends Schema.TaggedError<ImageInUse>()("ImageInUse", {
  ref: Schema.String,
  message: Schema.String,
  /** the ids of the sessions that would break (boot from its kernel, or back onto its root.raw) */
  sessions: Schema.optional(Schema.Array(Schema.String))
}) {}

/** `abox image import`: the archive is not an image abox takes, or it breaks a rule of untrusted input */
export class ImageImportRefused extends Schema.TaggedError<ImageImportRefused>()("ImageImportRefused", {
  reason: Schema.String,
  message: Schema.String
}) {}
