import type * as CommandExecutor from "@effect/platform/CommandExecutor"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { goldenOf, resolveImage } from "../lib/images.js"
import { makeRootDisk } from "../lib/rootDisk.js"
import { AboxPaths } from "../services/AboxPaths.js"
import { Images } from "../services/Images.js"

/** The Images service (src/services/Images.ts) over the on-disk registry. */
export const ImagesLive: Layer.Layer<Images, never, AboxPaths | CommandExecutor.CommandExecutor> =
  Layer.effect(
    Images,
    Effect.gen(function* () {
      const paths = yield* AboxPaths
      const context = yield* Effect.context<CommandExecutor.CommandExecutor>()
      return Images.of({
        resolve: (ref) =>
          resolveImage(paths.images, ref).pipe(
            Effect.map((image) => goldenOf(image)),
            Effect.withSpan("Images.resolve")
          ),
        cloneRoot: (image, dir, overlay) =>
          makeRootDisk(image, dir, overlay).pipe(Effect.provide(context), Effect.withSpan("Images.cloneRoot"))
      })
    })
  )
