import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as NodePath from "@effect/platform-node/NodePath"
import * as NodeTerminal from "@effect/platform-node/NodeTerminal"
import * as Layer from "effect/Layer"
import * as Logger from "effect/Logger"
import { backendEnv } from "../lib/env.js"
import { AboxPathsLive } from "../services/AboxPaths.js"
import { RuntimeLockLive } from "./RuntimeLockLive.js"
import { SecretScrubberLive } from "./SecretScrubberLive.js"
import { SessionStoreLive } from "./SessionStoreLive.js"

/**
 * Diagnostics (Effect's log) go to stderr, one logfmt line each (values JSON-quoted, so a newline
 * in a value cannot start a line of its own): stdout carries only a command's output, and under
 * `--json` only its JSON lines.
 */
export const LogToStderr = Logger.replace(Logger.defaultLogger, Logger.withConsoleError(Logger.logfmtLogger))

/**
 * The environment checked as the VMM layer reads it (ABOX_VMM and its backend's settings: a bad
 * value is ConfigInvalid, exit 64), for the commands that never build that layer: a value abox
 * does not accept is refused by every command alike.
 */
const EnvChecked = Layer.effectDiscard(backendEnv)

/**
 * What the commands that never start a VM need (list, show, name, rm, scrub…): the store, the
 * scrubber, the runtime lock, paths, file system, log and terminal. Nothing of the VM stack
 * (VMM backends, guest RPC, broker, images) is imported here, so a command that runs on this
 * layer (src/cli/dispatch.ts) never loads it: its start-up is a feature (docs/performance.md).
 */
export const BaseLive = Layer.mergeAll(SessionStoreLive, SecretScrubberLive, RuntimeLockLive, LogToStderr, EnvChecked).pipe(
  Layer.provideMerge(AboxPathsLive),
  // qemu-img for rm and gc of sessions with forks (their frozen layers' backing chains)
  Layer.provideMerge(NodeCommandExecutor.layer),
  Layer.provideMerge(Layer.merge(NodeFileSystem.layer, NodePath.layer)),
  Layer.merge(NodeTerminal.layer)
)
