import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as NodePath from "@effect/platform-node/NodePath"
import * as NodeTerminal from "@effect/platform-node/NodeTerminal"
import * as Layer from "effect/Layer"
import * as Logger from "effect/Logger"
import { AboxPathsLive } from "../services/AboxPaths.js"
import { LifecycleLive } from "./Lifecycle.js"
import { SecretScrubberLive } from "./SecretScrubberLive.js"
import { SessionStoreLive } from "./SessionStoreLive.js"

/**
 * Diagnostics (Effect's log) go to stderr, one logfmt line each (values JSON-quoted, so a newline
 * in a value cannot start a line of its own): stdout carries only a command's output, and under
 * `--json` only its JSON lines.
 */
export const LogToStderr = Logger.replace(Logger.defaultLogger, Logger.withConsoleError(Logger.logfmtLogger))

/** Every abox service on this platform: what the SDK provides. */
export const AboxLive = Layer.mergeAll(SessionStoreLive, SecretScrubberLive, LifecycleLive, LogToStderr).pipe(
  Layer.provideMerge(AboxPathsLive),
  Layer.provideMerge(Layer.merge(NodeFileSystem.layer, NodePath.layer))
)

/** The CLI's one main layer, provided once at the edge (src/bin.ts): the services and a terminal. */
export const MainLive = Layer.merge(AboxLive, NodeTerminal.layer)
