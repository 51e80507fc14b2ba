import * as Context from "effect/Context"
import type * as Effect from "effect/Effect"
import type { DiskError, GoldenImage, ImageNotFound } from "../domain/image.js"

/** What Open needs of the image registry and the disk tools. */
export interface ImagesShape {
  /** `undefined` → the default image; else `name` or `name@digest` */
  readonly resolve: (ref: string | undefined) => Effect.Effect<GoldenImage, ImageNotFound>
  /** golden root → session root.raw: reflink when possible, else a sparse-aware copy; checks free space */
  readonly cloneRoot: (image: GoldenImage, target: string) => Effect.Effect<void, DiskError>
}

export class Images extends Context.Tag("abox/Images")<Images, ImagesShape>() {}
