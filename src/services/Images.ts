import * as Context from "effect/Context"
import type * as Effect from "effect/Effect"
import * as Schema from "effect/Schema"
import type { GuestArch, ImageIdentity } from "./SessionStore.js"

/** A registered golden image, ready to clone and boot. */
export interface GoldenImage {
  readonly identity: ImageIdentity
  readonly arch: GuestArch
  readonly protocol: number
  readonly kernel: string
  readonly initrd: string
  readonly rootDisk: string
}

export class ImageNotFound extends Schema.TaggedError<ImageNotFound>()("ImageNotFound", {
  ref: Schema.String,
  message: Schema.String
}) {}

export class DiskError extends Schema.TaggedError<DiskError>()("DiskError", {
  path: Schema.String,
  reason: Schema.String,
  message: Schema.String
}) {}

/** What Open needs of the image registry and the disk tools. */
export interface ImagesShape {
  /** `undefined` → the default image; else `name` or `name@digest` */
  readonly resolve: (ref: string | undefined) => Effect.Effect<GoldenImage, ImageNotFound>
  /** golden root → session root.raw: reflink when possible, else a sparse-aware copy; checks free space */
  readonly cloneRoot: (image: GoldenImage, target: string) => Effect.Effect<void, DiskError>
}

export class Images extends Context.Tag("abox/Images")<Images, ImagesShape>() {}
