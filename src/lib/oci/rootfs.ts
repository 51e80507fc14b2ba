/**
 * The root file system of an imported OCI image (docs/images.md), built on the host without
 * running anything of the image:
 * 1. each layer (gzip or plain tar) is applied in order with the checked tar reader
 *    (src/guest/extract.ts: no `..`, no absolute path, nothing written through a link, devices
 *    refused, sizes and entries bounded) in its layer mode: whiteouts and opaque directories,
 *    and every entry's owner and full mode recorded; its uncompressed sha256 must be its diff_id;
 * 2. abox's runtime goes under /opt/abox, taken from a registered abox image's root (debugfs
 *    reads it; nothing is mounted): the agent bundle (and its snapshot), busybox with the applets
 *    init and the agent use (in /opt/abox/bin, first on the agent's PATH, never on the turns'),
 *    node with its own glibc and loader (/opt/abox/bin/node runs it through that loader, so the
 *    image's libc, musl or another glibc, does not matter), abox's init at /sbin/init (an OCI
 *    image's own init is never run), the image's Env for turns, the repository user `agent`
 *    (1000:1000) when the image has none;
 * 3. `mkfs.ext4 -d` makes root.raw from the tree, then one debugfs script sets every inode's
 *    recorded owner and mode (setuid bits too) and makes the FIFOs.
 * Every write into the tree outside the layers resolves its path inside the tree (a link of the
 * image is followed as the guest would, never onto the host).
 */
import * as Effect from "effect/Effect"
import * as crypto from "node:crypto"
import { constants as fsConstants, createReadStream } from "node:fs"
import * as fs from "node:fs/promises"
import * as path from "node:path"
import * as zlib from "node:zlib"
import { ExtractError, extractTar, type LayerEntry } from "../../guest/extract.js"
import { type GuestArch } from "../../domain/session.js"
import { IMAGE_ENV_FILE } from "../../domain/image.js"
import { errorMessage } from "../../domain/errorMessage.js"
import { alignDiskSize } from "../disk.js"
import { findTool, REPO_OWNER, runTool } from "../repoDisk.js"
import { escapeControl } from "../text.js"
import { type ImageConfig, type LayerBlob, refuse } from "./layout.js"

export interface ImportLimits {
  /** file bytes of all layers together, as their headers declare them */
  readonly maxBytes: number
  readonly maxEntries: number
}

const GiB = 1024 * 1024 * 1024
export const DEFAULT_IMPORT_LIMITS: ImportLimits = { maxBytes: 16 * GiB, maxEntries: 2_000_000 }

/** path (components joined by `/`) → what the image's file system must say of it */
export type Recorded = Map<string, LayerEntry>

const magic = async (file: string): Promise<Buffer> => {
  const handle = await fs.open(file, "r")
  try {
    const buffer = Buffer.alloc(4)
    await handle.read(buffer, 0, 4, 0)
    return buffer
  } finally {
    await handle.close()
  }
}

/** a blob's bytes uncompressed (gzip by its magic; zstd is refused: this node has no decoder) */
const uncompressed = async (file: string): Promise<AsyncIterable<Buffer>> => {
  const head = await magic(file)
  const raw = createReadStream(file, { highWaterMark: 1024 * 1024 })
  if (head[0] === 0x1f && head[1] === 0x8b) return raw.pipe(zlib.createGunzip())
  if (head.readUInt32LE(0) === 0xfd2fb528) {
    raw.destroy()
    throw new ExtractError(
      "a zstd-compressed layer: convert it first (skopeo copy --dest-compress-format gzip)"
    )
  }
  return raw
}

/** the bytes as they pass, hashed and bounded (a compression bomb of tar padding stops here) */
export async function* measured(source: AsyncIterable<Buffer>, hash: crypto.Hash | undefined, limit: number) {
  let seen = 0
  for await (const chunk of source) {
    seen += chunk.length
    if (seen > limit) throw new ExtractError(`it uncompresses to more than ${limit} bytes`)
    hash?.update(chunk)
    yield chunk
  }
}

/** apply the layers, in order, to the empty directory `root`; what each entry must be is recorded */
export const applyLayers = (root: string, layers: ReadonlyArray<LayerBlob>, limits: ImportLimits) =>
  Effect.gen(function* () {
    const recorded: Recorded = new Map()
    let bytes = 0
    let entries = 0
    for (const [i, layer] of layers.entries()) {
      const hash = crypto.createHash("sha256")
      const result = yield* Effect.tryPromise({
        try: async () =>
          extractTar(
            measured(
              await uncompressed(layer.file),
              hash,
              limits.maxBytes - bytes + 64 * 1024 * 1024 + limits.maxEntries * 1024
            ),
            root,
            {
              untrusted: { maxBytes: limits.maxBytes - bytes, maxEntries: limits.maxEntries - entries },
              layer: {
                record: (parts, entry) => void recorded.set(parts.join("/"), entry),
                removed: (parts) => {
                  const key = parts.join("/")
                  for (const other of recorded.keys())
                    if (other === key || other.startsWith(`${key}/`)) recorded.delete(other)
                }
              }
            }
          ),
        catch: (cause) =>
          refuse(
            "layer",
            `layer ${i + 1} of ${layers.length} (${layer.diffId}) was refused: ${escapeControl(
              cause instanceof ExtractError ? cause.reason : errorMessage(cause)
            )}`
          )
      })
      const digest = `sha256:${hash.digest("hex")}`
      if (digest !== layer.diffId)
        return yield* refuse(
          "digest",
          `layer ${i + 1} of ${layers.length} does not match its diff_id ${layer.diffId} (its tar is ${digest})`
        )
      bytes += result.bytes
      entries += result.files
    }
    return recorded
  })

const isErrno = (error: unknown, code: string) =>
  typeof error === "object" && error !== null && (error as { code?: unknown }).code === code

/**
 * `rel` (a path of the image, `/` separated) inside `root`: each directory component resolved
 * as the guest would (links of the image followed, relative to where they are, an absolute one
 * from the image's root; at most 40 of them), missing directories made (owned by root, 0755).
 * Returns the real relative path of its parent and its name; the name itself is not followed.
 */
const inside = async (root: string, rel: string, recorded: Recorded): Promise<string> => {
  let hops = 0
  const resolveDir = async (parts: ReadonlyArray<string>): Promise<Array<string>> => {
    const done: Array<string> = []
    const queue = [...parts]
    while (queue.length > 0) {
      const part = queue.shift()!
      if (part === "" || part === ".") continue
      if (part === "..") {
        done.pop()
        continue
      }
      const host = path.join(root, ...done, part)
      const stat = await fs.lstat(host).catch((error: unknown) => {
        if (isErrno(error, "ENOENT")) return undefined
        throw error
      })
      if (stat === undefined) {
        await fs.mkdir(host, { mode: 0o755 })
        recorded.set([...done, part].join("/"), { type: "Directory", mode: 0o755, uid: 0, gid: 0 })
        done.push(part)
      } else if (stat.isDirectory()) done.push(part)
      else if (stat.isSymbolicLink()) {
        if (++hops > 40) throw new ExtractError(`too many links under ${JSON.stringify(rel)}`)
        const target = await fs.readlink(host)
        if (target.startsWith("/")) done.length = 0
        queue.unshift(...target.split("/"))
      } else
        throw new ExtractError(
          `${JSON.stringify(rel)}: ${JSON.stringify(part)} is not a directory in the image`
        )
    }
    return done
  }
  const parts = rel.split("/").filter((part) => part !== "")
  const dir = await resolveDir(parts.slice(0, -1))
  return [...dir, parts[parts.length - 1]!].join("/")
}

/** a file of the image's tree replaced by `content` (a link there is replaced, never followed) */
const writeInside = async (
  root: string,
  rel: string,
  content: string | Buffer,
  entry: LayerEntry,
  recorded: Recorded
): Promise<string> => {
  const real = await inside(root, rel, recorded)
  const host = path.join(root, real)
  const stat = await fs.lstat(host).catch(() => undefined)
  if (stat?.isDirectory() === true) await fs.rm(host, { recursive: true, force: true })
  else if (stat !== undefined) await fs.unlink(host)
  const handle = await fs.open(
    host,
    fsConstants.O_WRONLY | fsConstants.O_CREAT | fsConstants.O_EXCL | fsConstants.O_NOFOLLOW,
    0o600
  )
  try {
    await handle.writeFile(content)
  } finally {
    await handle.close()
  }
  recorded.set(real, entry)
  return real
}

/** a directory of the image's tree (made when missing), recorded as `entry` when given */
const dirInside = async (root: string, rel: string, recorded: Recorded, entry?: LayerEntry) => {
  const real = await inside(root, `${rel}/.`, recorded)
  const dir = real.replace(/\/?\.$/, "")
  if (entry !== undefined) recorded.set(dir, entry)
  return dir
}

const readInside = async (root: string, rel: string, recorded: Recorded): Promise<string> => {
  const real = await inside(root, rel, recorded)
  const stat = await fs.lstat(path.join(root, real)).catch(() => undefined)
  return stat?.isFile() === true ? fs.readFile(path.join(root, real), "utf8") : ""
}

const LOADER: Record<GuestArch, { readonly triple: string; readonly loader: string }> = {
  x86_64: { triple: "x86_64-linux-gnu", loader: "ld-linux-x86-64.so.2" },
  aarch64: { triple: "aarch64-linux-gnu", loader: "ld-linux-aarch64.so.1" }
}

/** what init (images/root-init.sh) and the agent run (mount, tar, cp, …): busybox applets in /opt/abox/bin */
const APPLETS = [
  "sh",
  "mount",
  "umount",
  "grep",
  "mkdir",
  "hostname",
  "ip",
  "cat",
  "poweroff",
  "sync",
  "usleep",
  "sleep",
  "tar",
  "cp",
  "chown",
  "chmod",
  "ln",
  "rm",
  "ls",
  "mknod",
  "kill",
  "echo",
  "test",
  "[",
  "sed",
  "mv",
  "touch",
  "stat",
  "id",
  "env",
  "mountpoint",
  "blkid",
  "dd",
  "head",
  "tail",
  "ps",
  "true",
  "false"
]

/** `KEY=value` entries of the image's Env, without what abox sets for every turn itself */
export const imageEnv = (config: ImageConfig): Record<string, string> => {
  const env: Record<string, string> = {}
  for (const item of config.config?.Env ?? []) {
    const eq = item.indexOf("=")
    if (eq <= 0) continue
    const key = item.slice(0, eq)
    if (key === "HOME" || key === "USER") continue
    env[key] = item.slice(eq + 1)
  }
  return env
}

/**
 * Add abox's runtime to the tree at `root` from the base image's root disk `baseRoot` (a small
 * abox image: busybox, node and glibc at their usual places, the agent in /opt/abox).
 */
export const addRuntime = (options: {
  readonly root: string
  readonly work: string
  readonly baseRoot: string
  readonly arch: GuestArch
  readonly config: ImageConfig
  readonly recorded: Recorded
}) =>
  Effect.gen(function* () {
    const { root, work, baseRoot, recorded } = options
    const debugfs = yield* findTool("debugfs")
    if (debugfs === undefined) return yield* refuse("tool", "debugfs (e2fsprogs) is not installed")
    const { triple, loader } = LOADER[options.arch]
    const take = (from: string, into: string) =>
      runTool(baseRoot, debugfs, ["-R", `rdump "${from}" "${into}"`, baseRoot])
    const parts = path.join(work, "runtime")
    yield* Effect.tryPromise({
      try: () => fs.mkdir(parts, { recursive: true }),
      catch: (cause) => refuse("runtime", `${parts}: ${errorMessage(cause)}`)
    })
    yield* take("/opt/abox", parts)
    yield* take("/bin/busybox", parts)
    yield* take("/usr/local/bin/node", parts)
    yield* take(`/lib/${triple}`, parts)
    const init = yield* runTool(baseRoot, debugfs, ["-R", "cat /sbin/init", baseRoot])
    yield* Effect.tryPromise({
      try: async () => {
        const has = (file: string) =>
          fs.lstat(file).then(
            () => true,
            () => false
          )
        for (const need of ["abox/abox-guest.js", "busybox", "node", `${triple}/${loader}`])
          if (!(await has(path.join(parts, need)))) throw new ExtractError(`the base image has no ${need}`)
        if (!init.startsWith("#!")) throw new ExtractError("the base image has no /sbin/init")
        // /opt/abox: the image's own is replaced
        const opt = await dirInside(root, "opt", recorded)
        const abox = path.join(root, opt, "abox")
        await fs.rm(abox, { recursive: true, force: true })
        for (const key of recorded.keys()) if (key.startsWith(`${opt}/abox/`)) recorded.delete(key)
        await fs.rename(path.join(parts, "abox"), abox)
        await fs.mkdir(path.join(abox, "bin"), { recursive: true })
        await fs.mkdir(path.join(abox, "libexec"), { recursive: true })
        await fs.rename(path.join(parts, "busybox"), path.join(abox, "bin", "busybox"))
        await fs.rename(path.join(parts, "node"), path.join(abox, "libexec", "node"))
        await fs.rename(path.join(parts, triple), path.join(abox, "lib"))
        await fs.chmod(path.join(abox, "bin", "busybox"), 0o755)
        await fs.chmod(path.join(abox, "libexec", "node"), 0o755)
        for (const applet of APPLETS) await fs.symlink("busybox", path.join(abox, "bin", applet))
        // node through abox's own loader and glibc, whatever libc the image has
        await fs.writeFile(
          path.join(abox, "bin", "node"),
          `#!/opt/abox/bin/busybox sh\nexport ABOX_NODE=/opt/abox/bin/node\nexec /opt/abox/lib/${loader} --library-path /opt/abox/lib /opt/abox/libexec/node "$@"\n`,
          { mode: 0o755 }
        )
        await fs.chmod(path.join(abox, "bin", "node"), 0o755)
        await fs.writeFile(
          path.join(root, opt, "abox", path.basename(IMAGE_ENV_FILE)),
          JSON.stringify(imageEnv(options.config)),
          {
            mode: 0o644
          }
        )
        // every file of /opt/abox: root's, as the base image has them (their modes kept)
        // abox's init, its commands from /opt/abox/bin first
        const ownInit = init
          .replace(/^#!.*\n/, "#!/opt/abox/bin/busybox sh\n")
          .replace(/^export PATH=/m, "export PATH=/opt/abox/bin:")
        await writeInside(root, "sbin/init", ownInit, { type: "File", mode: 0o755, uid: 0, gid: 0 }, recorded)
        // the directories init and the agent need
        for (const [dir, entry] of [
          ["proc", undefined],
          ["sys", undefined],
          ["dev", undefined],
          ["run", undefined],
          ["tmp", { type: "Directory", mode: 0o1777, uid: 0, gid: 0 }],
          ["root", undefined],
          ["var/lib/abox", { type: "Directory", mode: 0o700, uid: 0, gid: 0 }],
          ["work", { type: "Directory", mode: 0o755, uid: 0, gid: 0 }],
          ["work/repo", { type: "Directory", mode: 0o755, uid: REPO_OWNER.uid, gid: REPO_OWNER.gid }]
        ] as const) {
          await dirInside(root, dir, recorded, entry)
        }
        // the repository user, when the image has none
        const passwd = await readInside(root, "etc/passwd", recorded)
        if (!passwd.split("\n").some((line) => line.startsWith("agent:"))) {
          const shell = (await fs.lstat(path.join(root, await inside(root, "bin/sh", recorded))).then(
            () => true,
            () => false
          ))
            ? "/bin/sh"
            : "/opt/abox/bin/sh"
          const line = `agent:x:${REPO_OWNER.uid}:${REPO_OWNER.gid}:repository owner:/home/agent:${shell}\n`
          const withNewline = passwd === "" || passwd.endsWith("\n") ? passwd : `${passwd}\n`
          await writeInside(
            root,
            "etc/passwd",
            withNewline + line,
            { type: "File", mode: 0o644, uid: 0, gid: 0 },
            recorded
          )
          const group = await readInside(root, "etc/group", recorded)
          if (!group.split("\n").some((g) => g.startsWith("agent:"))) {
            const groupNewline = group === "" || group.endsWith("\n") ? group : `${group}\n`
            await writeInside(
              root,
              "etc/group",
              `${groupNewline}agent:x:${REPO_OWNER.gid}:\n`,
              { type: "File", mode: 0o644, uid: 0, gid: 0 },
              recorded
            )
          }
          await dirInside(root, "home/agent", recorded, {
            type: "Directory",
            mode: 0o755,
            uid: REPO_OWNER.uid,
            gid: REPO_OWNER.gid
          })
        }
      },
      catch: (cause) =>
        refuse(
          "runtime",
          `adding abox's runtime: ${escapeControl(cause instanceof ExtractError ? cause.reason : errorMessage(cause))}`
        )
    })
  })

const TYPE_BITS: Record<LayerEntry["type"], number> = {
  Directory: 0o040000,
  File: 0o100000,
  SymbolicLink: 0o120000,
  FIFO: 0o010000
}

/** a name debugfs can take in a quoted argument */
const DEBUGFS_SAFE = /^[^\u0000-\u001f\u007f"\\]*$/

/** every entry of the tree, parents first */
const walk = async (root: string): Promise<Array<{ rel: string; isDir: boolean }>> => {
  const out: Array<{ rel: string; isDir: boolean }> = []
  const visit = async (rel: string) => {
    const entries = await fs.readdir(path.join(root, rel), { withFileTypes: true })
    entries.sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0))
    for (const entry of entries) {
      const child = rel === "" ? entry.name : `${rel}/${entry.name}`
      out.push({ rel: child, isDir: entry.isDirectory() })
      if (entry.isDirectory()) await visit(child)
    }
  }
  await visit("")
  return out
}

/** the debugfs commands that give each inode its recorded owner and mode, and make the FIFOs */
export const ownershipScript = (tree: ReadonlyArray<{ rel: string; isDir: boolean }>, recorded: Recorded) => {
  const lines: Array<string> = []
  for (const { rel, isDir } of tree) {
    if (!DEBUGFS_SAFE.test(rel))
      throw new ExtractError(
        `the name ${JSON.stringify(rel)} has a control character, a quote or a backslash`
      )
    const p = `"/${rel}"`
    const entry =
      recorded.get(rel) ?? (isDir ? { type: "Directory" as const, mode: 0o755, uid: 0, gid: 0 } : undefined)
    // a name with nothing recorded is a hard link: its inode is set through its first name
    if (entry === undefined) continue
    if (entry.type === "FIFO") {
      // debugfs links a new node by its name in the current directory
      const slash = rel.lastIndexOf("/")
      lines.push(`rm ${p}`, `cd "/${rel.slice(0, slash + 1)}"`, `mknod "${rel.slice(slash + 1)}" p`, "cd /")
    }
    if (entry.type !== "SymbolicLink")
      lines.push(`sif ${p} mode 0${(TYPE_BITS[entry.type] | entry.mode).toString(8)}`)
    lines.push(`sif ${p} uid ${entry.uid}`, `sif ${p} gid ${entry.gid}`)
  }
  return lines.join("\n") + "\n"
}

/** root.raw of the tree: its size room for the tree twice and 1 GiB more (sparse), at least 2 GiB */
export const makeRootDisk = (root: string, recorded: Recorded, out: string) =>
  Effect.gen(function* () {
    const mkfs = yield* findTool("mkfs.ext4")
    const debugfs = yield* findTool("debugfs")
    if (mkfs === undefined || debugfs === undefined)
      return yield* refuse("tool", "mkfs.ext4 and debugfs (e2fsprogs) are needed to import an image")
    const { tree, bytes } = yield* Effect.tryPromise({
      try: async () => {
        const tree = await walk(root)
        let bytes = 0
        for (const { rel } of tree) bytes += (await fs.lstat(path.join(root, rel))).blocks * 512
        return { tree, bytes }
      },
      catch: (cause) => refuse("tree", errorMessage(cause))
    })
    const script = yield* Effect.try({
      try: () => ownershipScript(tree, recorded),
      catch: (cause) =>
        refuse("name", cause instanceof ExtractError ? escapeControl(cause.reason) : errorMessage(cause))
    })
    const size = alignDiskSize(Math.max(2 * GiB, 2 * bytes + GiB))
    yield* Effect.tryPromise({
      try: async () => {
        await fs.rm(out, { force: true })
        await fs.writeFile(out, "")
        await fs.truncate(out, size)
      },
      catch: (cause) => refuse("disk", `${out}: ${errorMessage(cause)}`)
    })
    yield* runTool(out, mkfs, ["-q", "-F", "-L", "abox-root", "-E", "root_owner=0:0", "-d", root, out])
    const said = yield* runTool(out, debugfs, ["-w", "-f", "-", out], script)
    return { bytes, size, said }
  })
