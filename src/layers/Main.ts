import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as NodePath from "@effect/platform-node/NodePath"
import * as NodeTerminal from "@effect/platform-node/NodeTerminal"
import * as Layer from "effect/Layer"
import { AboxPathsLive } from "../services/AboxPaths.js"
import { LifecycleLive } from "./Lifecycle.js"
import { SecretScrubberLive } from "./SecretScrubberLive.js"
import { SessionStoreLive } from "./SessionStoreLive.js"

/** The platform the CLI runs on (what @effect/cli needs, and the file system). */
export const PlatformLive = Layer.mergeAll(NodeFileSystem.layer, NodePath.layer, NodeTerminal.layer)

/** The CLI's one main layer, provided once at the edge (src/bin.ts). */
export const MainLive = Layer.mergeAll(SessionStoreLive, SecretScrubberLive, LifecycleLive).pipe(
  Layer.provideMerge(AboxPathsLive),
  Layer.provideMerge(PlatformLive)
)
