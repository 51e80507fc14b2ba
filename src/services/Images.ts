import * as Context from "effect/Context"
import type * as Effect from "effect/Effect"
import type { DiskError, GoldenImage, ImageNotFound } from "../domain/image.js"
import type { RootDiskInfo } from "../domain/session.js"

/** What Open needs of the image registry and the disk tools. */
export interface ImagesShape {
  /** `undefined` → the default image; else `name` or `name@digest` */
  readonly resolve: (ref: string | undefined) => Effect.Effect<GoldenImage, ImageNotFound>
  /**
   * the golden's root → a new session's root disk in `dir` (src/lib/rootDisk.ts): a reflink
   * where possible, else with `overlay` (QEMU) a qcow2 overlay of the golden, else a
   * sparse-aware copy after a free-space check
   */
  readonly cloneRoot: (
    image: GoldenImage,
    dir: string,
    overlay: boolean
  ) => Effect.Effect<{ readonly file: string; readonly info: RootDiskInfo }, DiskError>
}

export class Images extends Context.Tag("abox/Images")<Images, ImagesShape>() {}
