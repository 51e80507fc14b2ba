/**
 * The owner's side of the file tools: a child process the agent starts as the repository owner
 * (`node -e`, uid and gid set at spawn), in the repository, in its own process group. The agent
 * never opens, creates or truncates a file of the repository itself, nor changes its own
 * credentials: a FIFO, a device or a file the owner keeps slow blocks this child at most, which
 * the tool's timeout and a cancel kill. The child refuses anything but a regular file: it opens
 * with O_NONBLOCK (a FIFO's open does not wait for its other end) and checks the descriptor.
 *
 * It runs from its own source (`fileOpChild.toString()`), so it names nothing outside itself.
 */
import { spawn } from "node:child_process"
import type * as NodeFs from "node:fs"
import type * as NodePath from "node:path"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Schema from "effect/Schema"
import type { TurnUser } from "../user.js"

/** the child's program: one request (JSON on stdin) → one reply (JSON on stdout) */
export const fileOpChild = (fs: typeof NodeFs, path: typeof NodePath, input: string): string => {
  const { O_RDONLY, O_WRONLY, O_CREAT, O_NOFOLLOW, O_NONBLOCK } = fs.constants
  const request = JSON.parse(input) as
    | { readonly op: "read"; readonly path: string; readonly max: number; readonly follow: boolean }
    | { readonly op: "write"; readonly path: string; readonly content: string; readonly parents: boolean }
  const kind = (stat: NodeFs.Stats): string | undefined =>
    stat.isFile()
      ? undefined
      : stat.isFIFO()
        ? "a FIFO"
        : stat.isCharacterDevice() || stat.isBlockDevice()
          ? "a device"
          : stat.isSocket()
            ? "a socket"
            : stat.isDirectory()
              ? "a directory"
              : "not a regular file"
  const refuse = (special: string) =>
    new Error(`${request.path} is ${special}; only regular files are read or written`)
  const regular = (fd: number) => {
    const special = kind(fs.fstatSync(fd))
    if (special !== undefined) throw refuse(special)
  }
  // said before the open too: a FIFO without a reader or a socket would only fail it with ENXIO
  // (the descriptor's check after the open is what holds when the path changes meanwhile)
  const before = (follow: boolean) => {
    let stat: NodeFs.Stats | undefined
    try {
      stat = follow ? fs.statSync(request.path) : fs.lstatSync(request.path)
    } catch {
      return // missing (a write creates it) or unreadable: the open says why
    }
    const special = stat.isSymbolicLink() ? undefined : kind(stat)
    if (special !== undefined) throw refuse(special)
  }
  try {
    if (request.op === "read") {
      before(request.follow)
      const fd = fs.openSync(request.path, O_RDONLY | O_NONBLOCK | (request.follow ? 0 : O_NOFOLLOW))
      try {
        regular(fd)
        const buffer = Buffer.alloc(request.max + 1)
        let length = 0
        for (;;) {
          const read = fs.readSync(fd, buffer, length, buffer.length - length, length)
          if (read === 0) break
          length += read
          if (length === buffer.length) break
        }
        return JSON.stringify({ ok: true, data: buffer.subarray(0, length).toString("base64") })
      } finally {
        fs.closeSync(fd)
      }
    }
    if (request.parents) fs.mkdirSync(path.dirname(request.path), { recursive: true })
    before(true)
    const fd = fs.openSync(request.path, O_WRONLY | O_CREAT | O_NONBLOCK, 0o666)
    try {
      regular(fd)
      fs.ftruncateSync(fd, 0)
      const bytes = Buffer.from(request.content, "utf8")
      let written = 0
      while (written < bytes.length)
        written += fs.writeSync(fd, bytes, written, bytes.length - written, written)
      return JSON.stringify({ ok: true })
    } finally {
      fs.closeSync(fd)
    }
  } catch (error) {
    return JSON.stringify({ ok: false, error: error instanceof Error ? error.message : String(error) })
  }
}

/** a file operation that could not be done; `message` is what the model sees */
export class FileOpError extends Data.TaggedError("FileOpError")<{
  readonly message: string
  readonly cause?: unknown
}> {}

export type FileOpRequest =
  | { readonly op: "read"; readonly path: string; readonly max: number; readonly follow: boolean }
  | { readonly op: "write"; readonly path: string; readonly content: string; readonly parents: boolean }

/** the child's answer: its one line of stdout, an untrusted process's output */
const FileOpReply = Schema.parseJson(
  Schema.Union(
    Schema.Struct({ ok: Schema.Literal(true), data: Schema.optional(Schema.String) }),
    Schema.Struct({ ok: Schema.Literal(false), error: Schema.String })
  )
)
const decodeReply = Schema.decodeUnknownEither(FileOpReply)

const CHILD_SCRIPT =
  `const fs = require("node:fs"), path = require("node:path"); let input = "";` +
  `process.stdin.setEncoding("utf8"); process.stdin.on("data", (chunk) => { input += chunk });` +
  `process.stdin.on("end", () => process.stdout.write((${fileOpChild.toString()})(fs, path, input)));`

/** process groups of running file operations, for the agent's last-resort kill */
const liveFileOps = new Set<number>()
const killGroup = (pid: number): void => {
  try {
    process.kill(-pid, "SIGKILL")
  } catch {
    // the group is gone
  }
}
export const killAllFileOps = (): void => {
  for (const pid of liveFileOps) killGroup(pid)
}

/**
 * Runs one request in a child as `user` (undefined: as the agent's own user) with `repoDir` as
 * its working directory, entered before the uid changes (libuv), so relative paths work under
 * directories the owner cannot traverse. The child gets no environment (NODE_OPTIONS and the
 * like are the turn's, not this process's). Interrupting the effect (a cancel, the tool's
 * timeout) SIGKILLs the child's group. `data` (a read's bytes) is at most `max + 1` bytes.
 */
export const runFileOp = (
  user: TurnUser | undefined,
  repoDir: string,
  request: FileOpRequest
): Effect.Effect<Buffer, FileOpError> =>
  Effect.async<Buffer, FileOpError>((resume) => {
    // base64 of a read's bytes, with room for the reply's frame
    const replyBound = request.op === "read" ? Math.ceil((request.max + 1) / 3) * 4 + 4096 : 64 * 1024
    let child: ReturnType<typeof spawn>
    try {
      child = spawn(process.execPath, ["-e", CHILD_SCRIPT], {
        cwd: repoDir,
        env: {},
        detached: true,
        stdio: ["pipe", "pipe", "pipe"],
        ...(user === undefined ? {} : { uid: user.uid, gid: user.gid })
      })
    } catch (cause) {
      resume(
        Effect.fail(new FileOpError({ message: `cannot start the file operation: ${String(cause)}`, cause }))
      )
      return
    }
    const pid = child.pid
    if (pid !== undefined) liveFileOps.add(pid)
    const chunks: Array<Buffer> = []
    let size = 0
    let stderr = ""
    let done = false
    const finish = (effect: Effect.Effect<Buffer, FileOpError>) => {
      if (done) return
      done = true
      if (pid !== undefined) {
        killGroup(pid)
        liveFileOps.delete(pid)
      }
      resume(effect)
    }
    child.stdin!.on("error", () => undefined)
    child.stdin!.end(JSON.stringify(request))
    child.stdout!.on("data", (chunk: Buffer) => {
      size += chunk.length
      if (size > replyBound) {
        finish(Effect.fail(new FileOpError({ message: "the file operation's reply is over its bound" })))
        return
      }
      chunks.push(chunk)
    })
    child.stderr!.on("data", (chunk: Buffer) => {
      if (stderr.length < 2048) stderr += chunk.toString("utf8")
    })
    child.once("error", (cause) =>
      finish(
        Effect.fail(new FileOpError({ message: `cannot start the file operation: ${cause.message}`, cause }))
      )
    )
    child.once("close", (code, signal) => {
      const reply = decodeReply(Buffer.concat(chunks).toString("utf8"))
      if (Either.isLeft(reply)) {
        const how = signal !== null ? `killed by ${signal}` : `exit ${code}`
        finish(
          Effect.fail(
            new FileOpError({
              message: `the file operation failed (${how})${stderr.trim() === "" ? "" : `: ${stderr.trim().slice(0, 500)}`}`,
              cause: reply.left
            })
          )
        )
        return
      }
      const value = reply.right
      finish(
        value.ok
          ? Effect.succeed(Buffer.from(value.data ?? "", "base64"))
          : Effect.fail(new FileOpError({ message: value.error }))
      )
    })
    return Effect.sync(() => {
      done = true
      if (pid !== undefined) {
        killGroup(pid)
        liveFileOps.delete(pid)
      }
      child.stdout?.destroy()
      child.stderr?.destroy()
    })
  })
