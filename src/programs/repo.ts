/**
 * The agent's work, out (and files, in): `abox diff`, `abox apply`, `abox cp`, and the SDK's
 * `session.diff()` / `session.files`. Each operation is a function of a `GuestConnection` (what
 * a session's holder has: the CLI that opened it, the SDK's handle, later a detached session's
 * control socket), plus `withConnection` for a stopped session, which boots it (Resume), runs
 * the operation and closes it again: one checked path (the protocol's export channel) for
 * every byte that leaves the guest, never a host-side parser of a disk the guest wrote.
 *
 * The baseline is what Open transferred, kept by the guest, root-owned and out of the turn
 * user's reach: the read-only repository disk on `/var/lib/abox/baseline` (or a copy there
 * after a tar transfer). A diff exports the baseline and the repository (less the top-level
 * `.git`, the user's own, which is copied as it is and never part of the patch), writes both
 * into a fresh host directory through the untrusted-archive extractor, and lets host git
 * compare two trees made from them with no filters and no configuration of the user's.
 */
import * as Effect from "effect/Effect"
import { createHash } from "node:crypto"
import * as fs from "node:fs/promises"
import * as os from "node:os"
import * as path from "node:path"
import { isGitName, safeComponents } from "../guest/extract.js"
import { removeTemp } from "../lib/atomicFile.js"
import { runCommand } from "../lib/command.js"
import { DEFAULT_LIMITS, DIFF_LIMITS, extractUntrusted } from "../lib/hostExtract.js"
import { scanSource, tarSnapshot } from "../lib/snapshot.js"
import type { GuestConnection } from "../services/GuestRpc.js"
import {
  ArchiveRefused,
  MergeConflicts,
  PatchFailed,
  RepoPathInvalid,
  RepoToolFailed,
  SourceChanged
} from "../domain/repoErrors.js"
import { SessionStore } from "../services/SessionStore.js"
import { GUEST_REPO, resume, type BootOptions } from "./session.js"
import { errorMessage } from "../domain/errorMessage.js"

/** the user's own repository metadata: copied in as it is, never part of a diff */
export const DIFF_EXCLUDE = [".git"]

const tool = (name: string, message: string) => new RepoToolFailed({ tool: name, message })
/** a host step that failed underneath: its message, and the failure itself as the cause */
const toolFailed = (name: string, message: string, cause: unknown) =>
  new RepoToolFailed({ tool: name, message: `${message}: ${errorMessage(cause)}`, cause })

/** a scoped temporary directory (removed with the scope) */
const tempDir = (parent: string = os.tmpdir(), prefix = "abox-") =>
  Effect.acquireRelease(
    Effect.tryPromise({
      try: () => fs.mkdtemp(path.join(parent, prefix)),
      catch: (cause) => tool("fs", `cannot create a temporary directory in ${parent}: ${errorMessage(cause)}`)
    }),
    (dir) => removeTemp(dir)
  )

/**
 * The most of a patch held in memory (a diff's output, the patch apply writes): beyond it the
 * diff is refused, naming the limit (docs/exit-codes.md, "limits")
 */
export const MAX_PATCH_BYTES = 256 * 1024 * 1024

/** git with no system/global configuration, no pager, no colour, never a prompt */
const git = (
  args: ReadonlyArray<string>,
  options: {
    readonly cwd?: string
    readonly env?: Record<string, string>
    readonly input?: Uint8Array | string
    /** stdout beyond this many bytes: git is killed and the patch refused */
    readonly maxOutput?: number
  } = {}
) =>
  runCommand("git", args, {
    cwd: options.cwd,
    input: options.input,
    maxOutput: options.maxOutput,
    env: {
      PATH: process.env.PATH ?? "/usr/bin:/bin",
      HOME: os.tmpdir(),
      LANG: "C",
      GIT_CONFIG_NOSYSTEM: "1",
      GIT_CONFIG_GLOBAL: "/dev/null",
      GIT_TERMINAL_PROMPT: "0",
      GIT_PAGER: "cat",
      ...options.env
    }
  }).pipe(
    Effect.catchTags({
      CommandNotRun: (error) =>
        Effect.fail(
          new RepoToolFailed({
            tool: "git",
            message: `git is needed on the host for this: ${errorMessage(error.cause)}`,
            cause: error
          })
        ),
      CommandOutputTooLarge: (error) =>
        Effect.fail(
          new ArchiveRefused({
            reason: "patch too big",
            message: `the patch is larger than ${error.limit} bytes: limit the diff to paths (-- <path>), or take big files out with abox cp`
          })
        )
    }),
    Effect.flatMap((result) =>
      result.exitCode === 0
        ? Effect.succeed(result.stdout)
        : Effect.fail(tool("git", `git ${args[0]} exited ${result.exitCode}: ${result.stderr.trim()}`))
    )
  )

/** a relative path inside the repository (no `..`, not absolute), normalised; "" is the root */
export const repoPath = (given: string): Effect.Effect<string, RepoPathInvalid> => {
  const inside =
    given === GUEST_REPO
      ? ""
      : given.startsWith(GUEST_REPO + "/")
        ? given.slice(GUEST_REPO.length + 1)
        : given
  const parts = inside.startsWith("/") ? "absolute path outside /work/repo" : safeComponents(inside)
  if (typeof parts === "string") {
    return Effect.fail(
      new RepoPathInvalid({
        path: given,
        message: `${JSON.stringify(given)} is not a path inside the repository (${parts})`
      })
    )
  }
  return Effect.succeed(parts.join("/"))
}

// ---- trees as git objects ----

interface TreeEntry {
  readonly path: string
  readonly mode: "100644" | "100755" | "120000"
}

const walk = async (root: string): Promise<ReadonlyArray<TreeEntry & { readonly full: string }>> => {
  const out: Array<TreeEntry & { readonly full: string }> = []
  const pending = [""]
  while (pending.length > 0) {
    const rel = pending.pop()!
    for (const entry of await fs.readdir(path.join(root, rel), { withFileTypes: true })) {
      const relPath = rel === "" ? entry.name : `${rel}/${entry.name}`
      const full = path.join(root, relPath)
      if (entry.isDirectory()) pending.push(relPath)
      else if (entry.isSymbolicLink()) out.push({ path: relPath, mode: "120000", full })
      else if (entry.isFile()) {
        const stat = await fs.lstat(full)
        out.push({ path: relPath, mode: (stat.mode & 0o111) !== 0 ? "100755" : "100644", full })
      }
    }
  }
  return out
}

/**
 * The git tree of a directory, written into `gitDir`: regular files as they are (hash-object
 * --no-filters: no attributes, no line-ending conversion), symlinks as links, modes as git
 * knows them. Empty directories have no place in a tree (nor in a patch).
 */
const writeTree = (gitDir: string, root: string, scratch: string) =>
  Effect.gen(function* () {
    const entries = yield* Effect.tryPromise({
      try: () => walk(root),
      catch: (cause) => tool("fs", `cannot read ${root}: ${errorMessage(cause)}`)
    })
    const env = { GIT_DIR: gitDir, GIT_INDEX_FILE: path.join(scratch, `index-${path.basename(root)}`) }
    // a link's blob is its target: written to scratch files and hashed with the rest; a file
    // whose name holds a newline (which --stdin-paths cannot take) is hashed through a scratch
    // hard link of it
    const sources = yield* Effect.tryPromise({
      try: async () =>
        Promise.all(
          entries.map(async (entry, i) => {
            const file = path.join(scratch, `entry-${path.basename(root)}-${i}`)
            if (entry.mode === "120000") {
              await fs.writeFile(file, await fs.readlink(entry.full, { encoding: "buffer" }))
              return file
            }
            if (!entry.full.includes("\n")) return entry.full
            await fs.link(entry.full, file)
            return file
          })
        ),
      catch: (cause) => tool("fs", `cannot read the entries of ${root}: ${errorMessage(cause)}`)
    })
    const ids =
      sources.length === 0
        ? []
        : (yield* git(["hash-object", "-w", "--no-filters", "--stdin-paths"], {
            env,
            input: sources.join("\n") + "\n"
          }))
            .toString("utf8")
            .trim()
            .split("\n")
    const info = entries.map((entry, i) => `${entry.mode} ${ids[i]}\t${entry.path}\0`).join("")
    yield* git(["update-index", "--add", "-z", "--index-info"], { env, input: info })
    return (yield* git(["write-tree"], { env })).toString("utf8").trim()
  })

export interface DiffOptions {
  /** limit to these repository paths */
  readonly paths?: ReadonlyArray<string> | undefined
  /** `git diff --stat` instead of the patch */
  readonly stat?: boolean | undefined
}

/** both trees from the guest (baseline and repository, less .git), in a scoped host directory */
const fetchTrees = (connection: GuestConnection) =>
  Effect.gen(function* () {
    const work = yield* tempDir()
    const base = path.join(work, "base")
    const repo = path.join(work, "repo")
    const gitDir = path.join(work, "objects.git")
    // only what differs: a diff costs what changed, not the size of the tree; bounded (one
    // file, all of it) before a byte is read; no `.git` at any depth (a nested repository's
    // config and hooks are not the work, and git refuses such paths in a tree)
    const limits = { ...DIFF_LIMITS, skipGit: true }
    yield* extractUntrusted(
      connection.exportTree({ tree: "baseline", paths: [], exclude: DIFF_EXCLUDE, changed: true }),
      base,
      limits
    )
    yield* extractUntrusted(
      connection.exportTree({ tree: "repo", paths: [], exclude: DIFF_EXCLUDE, changed: true }),
      repo,
      limits
    )
    yield* Effect.tryPromise({
      try: () => Promise.all([fs.mkdir(base, { recursive: true }), fs.mkdir(repo, { recursive: true })]),
      catch: (cause) => toolFailed("fs", `cannot create the trees to compare in ${work}`, cause)
    })
    yield* git(["init", "-q", "--bare", gitDir])
    const baseTree = yield* writeTree(gitDir, base, work)
    const repoTree = yield* writeTree(gitDir, repo, work)
    return { work, base, repo, gitDir, baseTree, repoTree }
  })

const diffArgs = (trees: { readonly baseTree: string; readonly repoTree: string }, options: DiffOptions) => [
  "--literal-pathspecs",
  "diff",
  "--no-color",
  "--no-ext-diff",
  "--no-textconv",
  "-M",
  ...(options.stat === true ? ["--stat"] : ["--binary", "--full-index"]),
  trees.baseTree,
  trees.repoTree,
  "--",
  ...(options.paths ?? [])
]

/**
 * The changes since the baseline as a git-format patch (new, modified, deleted, renamed where
 * git detects it, mode changes, symlinks, binary files as git binary patches) or, with `stat`,
 * its summary. `git apply` of it on a clean copy of the source reproduces the guest's tree.
 */
export const diff = Effect.fn("repo.diff")(function* (
  connection: GuestConnection,
  options: DiffOptions = {}
) {
  const paths = yield* Effect.forEach(options.paths ?? [], (p) => repoPath(p))
  return yield* Effect.scoped(
    Effect.gen(function* () {
      const trees = yield* fetchTrees(connection)
      const out = yield* git(diffArgs(trees, { ...options, paths }), {
        env: { GIT_DIR: trees.gitDir },
        maxOutput: MAX_PATCH_BYTES
      })
      return out.toString("utf8")
    })
  )
})

// ---- apply ----

const sameEntry = async (a: string, b: string): Promise<boolean> => {
  const [sa, sb] = await Promise.all([fs.lstat(a).catch(() => undefined), fs.lstat(b).catch(() => undefined)])
  if (sa === undefined || sb === undefined) return sa === sb
  if (sa.isSymbolicLink() !== sb.isSymbolicLink() || sa.isFile() !== sb.isFile()) return false
  if (sa.isSymbolicLink()) return (await fs.readlink(a)) === (await fs.readlink(b))
  if (!sa.isFile()) return sa.isDirectory() === sb.isDirectory()
  if (((sa.mode & 0o111) !== 0) !== ((sb.mode & 0o111) !== 0) || sa.size !== sb.size) return false
  const hash = async (file: string) =>
    createHash("sha256")
      .update(await fs.readFile(file))
      .digest("hex")
  return (await hash(a)) === (await hash(b))
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

/**
 * `git apply --3way` of the patch in `workTree` (the target, or a scratch copy of the touched
 * paths for `check`): a throwaway repository whose objects are the snapshot's and the guest's
 * blobs (the patch names them by full id), an index of the work tree's touched paths, no
 * attributes (info/attributes turns every filter and conversion off), no hooks, no user
 * configuration. Returns the paths left in conflict.
 */
const threeWayApply = (
  work: string,
  objects: string,
  workTree: string,
  touched: ReadonlyArray<string>,
  patch: Uint8Array
) =>
  Effect.gen(function* () {
    const gitDir = path.join(work, "merge.git")
    yield* git(["init", "-q", "--bare", "--template=", gitDir])
    yield* Effect.tryPromise({
      try: async () => {
        await fs.mkdir(path.join(gitDir, "info"), { recursive: true })
        await fs.writeFile(
          path.join(gitDir, "info", "attributes"),
          "* -text -eol -filter -ident -working-tree-encoding\n"
        )
        await fs.writeFile(
          path.join(gitDir, "objects", "info", "alternates"),
          path.join(objects, "objects") + "\n"
        )
      },
      catch: (cause) => tool("fs", `cannot prepare the merge repository: ${errorMessage(cause)}`)
    })
    const env = {
      GIT_DIR: gitDir,
      GIT_WORK_TREE: workTree,
      GIT_INDEX_FILE: path.join(work, "merge.index"),
      GIT_CEILING_DIRECTORIES: path.dirname(workTree),
      GIT_CONFIG_COUNT: "3",
      GIT_CONFIG_KEY_0: "core.bare",
      GIT_CONFIG_VALUE_0: "false",
      GIT_CONFIG_KEY_1: "core.hooksPath",
      GIT_CONFIG_VALUE_1: "/dev/null",
      GIT_CONFIG_KEY_2: "core.autocrlf",
      GIT_CONFIG_VALUE_2: "false"
    }
    const present: Array<string> = []
    for (const rel of touched) {
      const there = yield* Effect.promise(() =>
        fs.lstat(path.join(workTree, rel)).then(
          (stat) => !stat.isDirectory(),
          () => false
        )
      )
      if (there) present.push(rel)
    }
    if (present.length > 0)
      yield* git(["--literal-pathspecs", "add", "-f", "--", ...present], { cwd: workTree, env })
    const applied = yield* git(["apply", "--3way", "--whitespace=nowarn"], {
      cwd: workTree,
      env,
      input: patch
    }).pipe(Effect.either)
    const unmerged = (yield* git(["ls-files", "-u", "-z"], { cwd: workTree, env }))
      .toString("utf8")
      .split("\0")
      .filter((line) => line !== "")
      .map((line) => line.slice(line.indexOf("\t") + 1))
    const conflicts = [...new Set(unmerged)].sort()
    if (applied._tag === "Left" && conflicts.length === 0)
      return yield* new PatchFailed({ message: applied.left.message })
    return conflicts
  })

/**
 * Applies the session's changes to a host directory (by default the source it was opened
 * from). Refuses with `SourceChanged` (and the paths) when any path the patch touches differs
 * there from the snapshot: the user's own edits since Open are never overwritten. Returns the
 * paths it changed.
 */
export const apply = Effect.fn("repo.apply")(function* (connection: GuestConnection, options: ApplyOptions) {
  const paths = yield* Effect.forEach(options.paths ?? [], (p) => repoPath(p))
  const target = path.resolve(options.to)
  return yield* Effect.scoped(
    Effect.gen(function* () {
      const trees = yield* fetchTrees(connection)
      const env = { GIT_DIR: trees.gitDir }
      // old and new names of everything the patch touches (-z: any name, verbatim)
      const status = (yield* git(
        [
          "--literal-pathspecs",
          "diff",
          "--name-status",
          "-z",
          "-M",
          trees.baseTree,
          trees.repoTree,
          "--",
          ...paths
        ],
        { env }
      ))
        .toString("utf8")
        .split("\0")
      const touched = new Set<string>()
      for (let i = 0; i < status.length - 1;) {
        const code = status[i]!
        if (code.startsWith("R") || code.startsWith("C")) {
          touched.add(status[i + 1]!)
          touched.add(status[i + 2]!)
          i += 3
        } else {
          touched.add(status[i + 1]!)
          i += 2
        }
      }
      if (touched.size === 0) return [] as ReadonlyArray<string>
      const conflicts: Array<string> = []
      for (const rel of [...touched].sort()) {
        const same = yield* Effect.promise(() =>
          sameEntry(path.join(trees.base, rel), path.join(target, rel))
        )
        if (!same) conflicts.push(rel)
      }
      if (conflicts.length > 0 && options.threeWay === true) {
        const patch = yield* git(diffArgs(trees, { paths }), { env, maxOutput: MAX_PATCH_BYTES })
        const sorted = [...touched].sort()
        let workTree = target
        if (options.check === true) {
          // a scratch copy of the touched paths: the merge is tried there, the target untouched
          workTree = path.join(trees.work, "check")
          yield* Effect.tryPromise({
            try: async () => {
              await fs.mkdir(workTree)
              for (const rel of sorted) {
                const from = path.join(target, rel)
                const stat = await fs.lstat(from).catch(() => undefined)
                if (stat === undefined || stat.isDirectory()) continue
                await fs.mkdir(path.dirname(path.join(workTree, rel)), { recursive: true })
                await fs.cp(from, path.join(workTree, rel), { verbatimSymlinks: true })
              }
            },
            catch: (cause) => tool("fs", `cannot copy the target's paths for --check: ${errorMessage(cause)}`)
          })
        }
        const merged = yield* threeWayApply(trees.work, trees.gitDir, workTree, sorted, patch)
        if (merged.length > 0) {
          return yield* new MergeConflicts({
            target,
            paths: merged,
            applied: options.check === true ? [] : sorted.filter((p) => !merged.includes(p)),
            message:
              `${options.check === true ? "the three-way merge would leave" : "applied; the three-way merge left"} ` +
              `conflicts in ${target}: ${merged.join(", ")}`
          })
        }
        return sorted as ReadonlyArray<string>
      }
      if (conflicts.length > 0) {
        return yield* new SourceChanged({
          source: target,
          paths: conflicts,
          message: `${target} changed since the snapshot where the patch writes: ${conflicts.join(", ")}`
        })
      }
      const patch = yield* git(diffArgs(trees, { paths }), { env, maxOutput: MAX_PATCH_BYTES })
      // applied as a plain patch in the target: no repository above it is looked for, and the
      // user's whitespace settings do not refuse the agent's lines
      const applyEnv = { GIT_CEILING_DIRECTORIES: path.dirname(target) }
      const applyArgs = ["apply", "--whitespace=nowarn", ...(options.check === true ? ["--check"] : [])]
      yield* git(applyArgs, { cwd: target, env: applyEnv, input: patch }).pipe(
        Effect.mapError((error) => new PatchFailed({ message: error.message }))
      )
      return [...touched].sort() as ReadonlyArray<string>
    })
  )
})

// ---- files ----

export interface CopyOutOptions {
  /**
   * bring `.git` entries (directories, files, links, at any depth) out too: a guest-written
   * repository's config and hooks run commands the guest chose in the next `git status` there
   */
  readonly includeGit?: boolean | undefined
}

/**
 * `abox cp <ref>:<path> <host>`: the guest's file or directory to `host` (a new name, or into a
 * directory). Every link must stay inside what was copied; `.git` stays in the guest unless
 * `includeGit`.
 */
export const copyOut = Effect.fn("repo.copyOut")(function* (
  connection: GuestConnection,
  guestPath: string,
  hostPath: string,
  options: CopyOutOptions = {}
) {
  const rel = yield* repoPath(guestPath)
  const includeGit = options.includeGit === true
  if (!includeGit && rel.split("/").some((part) => isGitName(part))) {
    return yield* new RepoPathInvalid({
      path: guestPath,
      message: `${guestPath} is repository metadata the guest wrote (its config and hooks run commands): copy it only with --include-git`
    })
  }
  let destination = path.resolve(hostPath)
  const existing = yield* Effect.promise(() => fs.stat(destination).catch(() => undefined))
  if (existing?.isDirectory() === true)
    destination = path.join(destination, rel === "" ? "repo" : path.posix.basename(rel))
  const taken = yield* Effect.promise(() =>
    fs.lstat(destination).then(
      () => true,
      () => false
    )
  )
  if (taken) {
    return yield* new RepoPathInvalid({
      path: destination,
      message: `${destination} already exists: nothing was written`
    })
  }
  return yield* Effect.scoped(
    Effect.gen(function* () {
      // next to the destination, so that the final step is one rename on one file system
      const staging = yield* tempDir(path.dirname(destination), ".abox-cp-")
      const result = yield* extractUntrusted(connection.exportTree({ tree: "repo", paths: [rel] }), staging, {
        ...DEFAULT_LIMITS,
        linksWithin: rel === "" ? [] : rel.split("/"),
        skipGit: !includeGit
      })
      const source = path.join(staging, rel)
      yield* Effect.tryPromise({
        try: () => fs.rename(source, destination),
        catch: (cause) =>
          new RepoPathInvalid({
            path: guestPath,
            message: `${guestPath} is not in the session: ${errorMessage(cause)}`
          })
      })
      return { ...result, path: destination }
    })
  )
})

/** `abox cp <host> <ref>:<dir>`: a host file or directory into the guest directory `guestDir`, owned by the repository user */
export const copyIn = Effect.fn("repo.copyIn")(function* (
  connection: GuestConnection,
  hostPath: string,
  guestDir: string
) {
  const rel = yield* repoPath(guestDir)
  const source = path.resolve(hostPath)
  const stat = yield* Effect.tryPromise({
    try: () => fs.lstat(source),
    catch: (cause) =>
      new RepoPathInvalid({ path: source, message: `cannot read ${source}: ${errorMessage(cause)}` })
  })
  if (stat.isDirectory()) yield* scanSource(source)
  const target = rel === "" ? GUEST_REPO : `${GUEST_REPO}/${rel}`
  const tar = tarSnapshot(path.dirname(source), [path.basename(source)]).tar
  return yield* connection.transfer(tar, target)
})

/** the bytes of one file of the repository */
export const readFile = Effect.fn("repo.readFile")(function* (
  connection: GuestConnection,
  guestPath: string
) {
  const rel = yield* repoPath(guestPath)
  return yield* Effect.scoped(
    Effect.gen(function* () {
      const staging = yield* tempDir()
      yield* extractUntrusted(connection.exportTree({ tree: "repo", paths: [rel] }), staging, {
        ...DEFAULT_LIMITS,
        linksWithin: []
      })
      return yield* Effect.tryPromise({
        try: () => fs.readFile(path.join(staging, rel)),
        catch: (cause) =>
          new RepoPathInvalid({
            path: guestPath,
            message: `${guestPath}: not a file (${errorMessage(cause)})`
          })
      }).pipe(Effect.map((buffer) => new Uint8Array(buffer)))
    })
  )
})

/** writes one file of the repository (created or replaced), owned by the repository user */
export const writeFile = Effect.fn("repo.writeFile")(function* (
  connection: GuestConnection,
  guestPath: string,
  data: Uint8Array | string,
  mode = 0o644
) {
  const rel = yield* repoPath(guestPath)
  if (rel === "") return yield* new RepoPathInvalid({ path: guestPath, message: "a file needs a name" })
  return yield* Effect.scoped(
    Effect.gen(function* () {
      const staging = yield* tempDir()
      const file = path.join(staging, path.posix.basename(rel))
      yield* Effect.tryPromise({
        try: () => fs.writeFile(file, data, { mode }),
        catch: (cause) => tool("fs", `cannot stage ${guestPath}: ${errorMessage(cause)}`)
      })
      yield* Effect.tryPromise({
        try: () => fs.chmod(file, mode),
        catch: (cause) => toolFailed("fs", `cannot stage ${guestPath}`, cause)
      })
      const dir = path.posix.dirname(rel)
      const tar = tarSnapshot(staging, [path.posix.basename(rel)]).tar
      return yield* connection.transfer(tar, dir === "." ? GUEST_REPO : `${GUEST_REPO}/${dir}`)
    })
  )
})

export interface RepoEntry {
  readonly path: string
  readonly type: "file" | "directory" | "symlink"
  readonly size: number
  readonly mode: number
}

/** the entries under a repository directory (recursively), as the guest has them */
export const listFiles = Effect.fn("repo.listFiles")(function* (connection: GuestConnection, guestPath = "") {
  const rel = yield* repoPath(guestPath)
  return yield* Effect.scoped(
    Effect.gen(function* () {
      const staging = yield* tempDir()
      yield* extractUntrusted(
        connection.exportTree({ tree: "repo", paths: rel === "" ? [] : [rel] }),
        staging
      )
      return yield* Effect.tryPromise({
        try: async () => {
          const out: Array<RepoEntry> = []
          const pending = [rel]
          while (pending.length > 0) {
            const dir = pending.pop()!
            const names = await fs.readdir(path.join(staging, dir)).catch(() => [])
            for (const name of names.sort()) {
              const relPath = dir === "" ? name : `${dir}/${name}`
              const stat = await fs.lstat(path.join(staging, relPath))
              const type = stat.isDirectory() ? "directory" : stat.isSymbolicLink() ? "symlink" : "file"
              out.push({ path: relPath, type, size: stat.isFile() ? stat.size : 0, mode: stat.mode & 0o7777 })
              if (type === "directory") pending.push(relPath)
            }
          }
          return out.sort((a, b) =>
            a.path < b.path ? -1 : a.path > b.path ? 1 : 0
          ) as ReadonlyArray<RepoEntry>
        },
        catch: (cause) =>
          toolFailed("fs", `cannot list the guest's ${guestPath === "" ? "repository" : guestPath}`, cause)
      })
    })
  )
})

/**
 * A stopped session: boots it (Resume), runs `operation` on its connection, closes it. A
 * session another process holds (running) fails `SessionBusy`: its holder runs the operation
 * (a detached session's supervisor, `viaSupervisorOr` in src/programs/detached.ts).
 */
export const withConnection = <A, E, R>(
  ref: string,
  operation: (
    connection: GuestConnection,
    session: { readonly id: string; readonly source: string }
  ) => Effect.Effect<A, E, R>,
  options: BootOptions = {}
) =>
  Effect.scoped(
    Effect.gen(function* () {
      const session = yield* resume(ref, options)
      return yield* operation(session.connection, { id: session.id, source: session.meta.source })
    })
  )

/** the recorded source of a session (apply's default target) */
export const recordedSource = (ref: string) =>
  Effect.gen(function* () {
    const store = yield* SessionStore
    const id = yield* store.resolve(ref)
    return (yield* store.get(id)).source
  })
