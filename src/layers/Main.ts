import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as NodePath from "@effect/platform-node/NodePath"
import * as NodeTerminal from "@effect/platform-node/NodeTerminal"
import * as Layer from "effect/Layer"
import { AboxPathsLive } from "../services/AboxPaths.js"
import { LogToStderr } from "./Base.js"
import { LifecycleLive } from "./Lifecycle.js"
import { SecretScrubberLive } from "./SecretScrubberLive.js"
import { SessionStoreLive } from "./SessionStoreLive.js"

/** Every abox service on this platform: what the SDK provides. */
export const AboxLive = Layer.mergeAll(SessionStoreLive, SecretScrubberLive, LifecycleLive, LogToStderr).pipe(
  Layer.provideMerge(AboxPathsLive),
  // host tools (git, mkfs.ext4, qemu-img…) run through Command (src/lib/command.ts)
  Layer.provideMerge(NodeCommandExecutor.layer),
  Layer.provideMerge(Layer.merge(NodeFileSystem.layer, NodePath.layer))
)

/** The CLI's one main layer, provided once at the edge (src/bin.ts): the services and a terminal. */
export const MainLive = Layer.merge(AboxLive, NodeTerminal.layer)
