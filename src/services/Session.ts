/**
 * One contract for a session, wherever it runs: in this process (`localSession`,
 * src/programs/repo.ts, over the Session that `open`/`resume` hold) or in a supervisor's
 * (`remoteSession`, src/programs/detached.ts, over the control plane's RpcClient). The CLI and
 * the SDK run a turn, a diff, an apply and the file operations through it, whichever it is.
 */
import type * as Effect from "effect/Effect"
import type * as Stream from "effect/Stream"
import type { TurnLimits } from "../protocol/Messages.js"
import type { TurnEvent } from "./GuestRpc.js"

export interface DiffOptions {
  /** limit to these repository paths */
  readonly paths?: ReadonlyArray<string> | undefined
  /** `git diff --stat` instead of the patch */
  readonly stat?: boolean | undefined
}

export interface ApplyOptions {
  /** where to apply (default: the session's recorded source) */
  readonly to: string
  /** only check: nothing is written */
  readonly check?: boolean | undefined
  /**
   * where the target changed since the snapshot: a three-way merge with the snapshot as its base
   * instead of the refusal; clean paths apply, conflicts keep markers (MergeConflicts)
   */
  readonly threeWay?: boolean | undefined
  readonly paths?: ReadonlyArray<string> | undefined
}

export interface CopyOutOptions {
  /**
   * bring `.git` entries (directories, files, links, at any depth) out too: a guest-written
   * repository's config and hooks run commands the guest chose in the next `git status` there
   */
  readonly includeGit?: boolean | undefined
}

export interface RepoEntry {
  readonly path: string
  readonly type: "file" | "directory" | "symlink"
  readonly size: number
  readonly mode: number
}

/** the repository operations of a session; `E` is what they fail with on that side */
export interface SessionRepo<E, R = never> {
  readonly diff: (options?: DiffOptions) => Effect.Effect<string, E, R>
  readonly apply: (options: ApplyOptions) => Effect.Effect<ReadonlyArray<string>, E, R>
  readonly copyOut: (
    guestPath: string,
    hostPath: string,
    options?: CopyOutOptions
  ) => Effect.Effect<{ readonly files: number; readonly bytes: number; readonly path: string }, E, R>
  readonly copyIn: (
    hostPath: string,
    guestDir: string
  ) => Effect.Effect<{ readonly files: number; readonly bytes: number }, E, R>
  readonly readFile: (guestPath: string) => Effect.Effect<Uint8Array, E, R>
  /** the bytes written */
  readonly writeFile: (
    guestPath: string,
    data: Uint8Array | string,
    mode?: number
  ) => Effect.Effect<number, E, R>
  readonly listFiles: (guestPath?: string) => Effect.Effect<ReadonlyArray<RepoEntry>, E, R>
}

/** a session's turns and repository operations */
export interface SessionContract<E, R = never> extends SessionRepo<E, R> {
  /**
   * one turn: the guest's events as they come (stdout/stderr with their exact bytes), ending
   * with `End`; interrupting the stream cancels the turn
   */
  readonly turn: (
    text: string,
    mode?: "shell" | "prompt",
    limits?: TurnLimits
  ) => Stream.Stream<TurnEvent, E, R>
}
