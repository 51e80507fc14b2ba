import * as FileSystem from "@effect/platform/FileSystem"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as path from "node:path"
import { SessionStoreLive } from "../src/layers/SessionStoreLive.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { SessionStore } from "../src/services/SessionStore.js"

/** a fresh temp ABOX_HOME (and user home, for the legacy dir) with a SessionStore over it */
export const tempStore = Effect.gen(function* () {
  const fs = yield* FileSystem.FileSystem
  const root = yield* fs.makeTempDirectoryScoped({ prefix: "abox-store-" })
  const home = path.join(root, "abox")
  const userHome = path.join(root, "user")
  const legacySessions = path.join(userHome, "Library", "Application Support", "ABox", "sessions")
  const store = yield* SessionStore.pipe(
    Effect.provide(SessionStoreLive.pipe(Layer.provide(aboxPathsAt(home, userHome))))
  )
  return { root, home, userHome, legacySessions, store, fs }
}).pipe(Effect.provide(NodeFileSystem.layer))
