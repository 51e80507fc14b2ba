import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as NodePath from "@effect/platform-node/NodePath"
import * as NodeTerminal from "@effect/platform-node/NodeTerminal"
import * as Layer from "effect/Layer"
import { AboxPathsLive } from "../services/AboxPaths.js"
import * as Effect from "effect/Effect"
import { SecretScrubber } from "../services/SecretScrubber.js"
import { SessionStoreLive } from "./SessionStoreLive.js"

// PENDING: src/layers/SecretScrubberLive.ts is not written yet; until it is, the start-up
// scrub reports that it scanned nothing. Replace with `import { SecretScrubberLive } ...`.
const SecretScrubberLive = Layer.succeed(SecretScrubber, {
  scrub: ({ dryRun }) =>
    Effect.succeed({ dryRun, sessionsScanned: 0, filesScanned: 0, findings: [], problems: [] })
})

/** The platform the CLI runs on (what @effect/cli needs, and the file system). */
export const PlatformLive = Layer.mergeAll(NodeFileSystem.layer, NodePath.layer, NodeTerminal.layer)

/** The CLI's one main layer, provided once at the edge (src/bin.ts). */
export const MainLive = Layer.mergeAll(SessionStoreLive, SecretScrubberLive).pipe(
  Layer.provideMerge(AboxPathsLive),
  Layer.provideMerge(PlatformLive)
)
