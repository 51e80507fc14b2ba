/**
 * The owner's side of the file tools: one long-lived child process the agent starts as the
 * repository owner (`node -e`, uid and gid set at spawn, no environment), in the repository, in
 * its own process group, started on the first file operation and kept for the calls that follow
 * (a node start is ~0.4 s under TCG). The agent never opens, creates or truncates a file of the
 * repository itself, nor changes its own credentials: a FIFO, a device or a file the owner keeps
 * slow blocks this child at most, which the tool's timeout and a cancel kill (the next operation
 * starts a new child). The child refuses anything but a regular file: it opens with O_NONBLOCK
 * (a FIFO's open does not wait for its other end) and checks the descriptor.
 *
 * The conversation is JSON lines over the child's stdio, one request at a time: `{id, op, …}` in,
 * `{id, ok, data | error}` out. The child's lines are an untrusted process's output: each is
 * bounded (a read's bytes in base64, with room for the frame) and decoded with a Schema; a reply
 * that is too long, malformed or for another id ends the child. The requests are the agent's own.
 *
 * It runs from its own source (`fileOpChild.toString()`), so it names nothing outside itself.
 */
import { spawn, type ChildProcess } from "node:child_process"
import type * as NodeFs from "node:fs"
import type * as NodePath from "node:path"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Schema from "effect/Schema"
import { killGroup } from "../processGroup.js"
import type { TurnUser } from "../user.js"

/** the child's program for one request line → its reply line (without the newline) */
/**
 * how to start node again: an imported image's node runs through abox's own loader
 * (/opt/abox/bin/node, src/lib/oci/rootfs.ts), where `process.execPath` is that loader, so its
 * wrapper names itself in ABOX_NODE (set by root's init, never by a turn)
 */
const nodeCommand = (): string => {
  const named = process.env.ABOX_NODE
  return named !== undefined && named.startsWith("/") ? named : process.execPath
}

export const fileOpChild = (fs: typeof NodeFs, path: typeof NodePath, input: string): string => {
  const { O_RDONLY, O_WRONLY, O_CREAT, O_NOFOLLOW, O_NONBLOCK } = fs.constants
  const request = JSON.parse(input) as { readonly id: number } & (
    | { readonly op: "read"; readonly path: string; readonly max: number; readonly follow: boolean }
    | { readonly op: "write"; readonly path: string; readonly content: string; readonly parents: boolean }
  )
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
        return JSON.stringify({
          id: request.id,
          ok: true,
          data: buffer.subarray(0, length).toString("base64")
        })
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
      return JSON.stringify({ id: request.id, ok: true })
    } finally {
      fs.closeSync(fd)
    }
  } catch (error) {
    return JSON.stringify({
      id: request.id,
      ok: false,
      error: error instanceof Error ? error.message : String(error)
    })
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

/** one reply line of the child: an untrusted process's output */
const FileOpReply = Schema.parseJson(
  Schema.Union(
    Schema.Struct({ id: Schema.Number, ok: Schema.Literal(true), data: Schema.optional(Schema.String) }),
    Schema.Struct({ id: Schema.Number, ok: Schema.Literal(false), error: Schema.String })
  )
)
const decodeReply = Schema.decodeUnknownEither(FileOpReply)

/** request lines in, one reply line each out (in order), until stdin ends */
const CHILD_SCRIPT =
  `const fs = require("node:fs"), path = require("node:path"); const op = ${fileOpChild.toString()};` +
  `let parts = []; process.stdin.on("data", (chunk) => { let nl;` +
  ` while ((nl = chunk.indexOf(10)) >= 0) { parts.push(chunk.subarray(0, nl));` +
  ` const line = Buffer.concat(parts).toString("utf8"); parts = []; chunk = chunk.subarray(nl + 1);` +
  ` process.stdout.write(op(fs, path, line) + "\\n") }` +
  ` if (chunk.length > 0) parts.push(chunk) });` +
  `process.stdin.on("end", () => process.exit(0));`

/** a reply line's bound for a request (a read's base64, with room for the frame) */
const replyBound = (request: FileOpRequest): number =>
  request.op === "read" ? Math.ceil((request.max + 1) / 3) * 4 + 4096 : 64 * 1024

interface Pending {
  readonly id: number
  readonly bound: number
  readonly resume: (effect: Effect.Effect<Buffer, FileOpError>) => void
}

/** a started child: its process, what it has sent of the current line, the request it answers */
interface Child {
  readonly process: ChildProcess
  readonly pid: number
  chunks: Array<Buffer>
  size: number
  stderr: string
  pending: Pending | undefined
}

/** every live owner child, for the agent's last-resort kill */
const liveChildren = new Set<FileOpChild>()
export const killAllFileOps = (): void => {
  for (const files of liveChildren) files.close()
}

/**
 * The owner's file operations for one repository: a child as `user` (undefined: as the agent's
 * own user) with `repoDir` as its working directory, entered before the uid changes (libuv), so
 * relative paths work under directories the owner cannot traverse. The child gets no environment
 * (NODE_OPTIONS and the like are the turn's, not this process's). Interrupting an operation (a
 * cancel, the tool's timeout) SIGKILLs the child's group; so does `close`.
 */
export class FileOpChild {
  private child: Child | undefined
  private nextId = 1
  private readonly lock = Effect.unsafeMakeSemaphore(1)

  constructor(
    private readonly user: TurnUser | undefined,
    private readonly repoDir: string
  ) {}

  /** `data` (a read's bytes) is at most `max + 1` bytes */
  run(request: FileOpRequest): Effect.Effect<Buffer, FileOpError> {
    return this.lock.withPermits(1)(Effect.suspend(() => this.send(request)))
  }

  /** the child is killed (a new one starts with the next operation) */
  close(): void {
    const child = this.child
    if (child === undefined) return
    this.child = undefined
    liveChildren.delete(this)
    killGroup(child.pid, "SIGKILL")
    child.process.stdin?.destroy()
    child.process.stdout?.destroy()
    child.process.stderr?.destroy()
    child.pending?.resume(Effect.fail(new FileOpError({ message: "the file operation was stopped" })))
    child.pending = undefined
  }

  private send(request: FileOpRequest): Effect.Effect<Buffer, FileOpError> {
    return Effect.async<Buffer, FileOpError>((resume) => {
      const started = this.child === undefined ? this.start() : Either.right(this.child)
      if (Either.isLeft(started)) {
        resume(Effect.fail(started.left))
        return
      }
      const child = started.right
      const id = this.nextId++
      let done = false
      child.pending = {
        id,
        bound: replyBound(request),
        resume: (effect) => {
          if (done) return
          done = true
          resume(effect)
        }
      }
      child.process.stdin!.write(JSON.stringify({ id, ...request }) + "\n")
      // interrupted (cancel, timeout): the child may be stalled in this operation; it goes
      return Effect.sync(() => {
        if (done) return
        done = true
        if (this.child === child) this.close()
      })
    })
  }

  private start(): Either.Either<Child, FileOpError> {
    let spawned: ChildProcess
    try {
      spawned = spawn(nodeCommand(), ["-e", CHILD_SCRIPT], {
        cwd: this.repoDir,
        env: {},
        detached: true,
        stdio: ["pipe", "pipe", "pipe"],
        ...(this.user === undefined ? {} : { uid: this.user.uid, gid: this.user.gid })
      })
    } catch (cause) {
      return Either.left(
        new FileOpError({ message: `cannot start the file operation: ${String(cause)}`, cause })
      )
    }
    if (spawned.pid === undefined) {
      // the spawn failed; its error event says why
      const failure = new FileOpError({ message: "cannot start the file operation" })
      spawned.once("error", () => undefined)
      return Either.left(failure)
    }
    const child: Child = {
      process: spawned,
      pid: spawned.pid,
      chunks: [],
      size: 0,
      stderr: "",
      pending: undefined
    }
    this.child = child
    liveChildren.add(this)
    const fail = (message: string, cause?: unknown) => {
      const pending = child.pending
      child.pending = undefined
      if (this.child === child) this.close()
      pending?.resume(Effect.fail(new FileOpError({ message, cause })))
    }
    spawned.stdin!.on("error", () => undefined)
    spawned.stdout!.on("data", (chunk: Buffer) => this.receive(child, chunk, fail))
    spawned.stderr!.on("data", (chunk: Buffer) => {
      if (child.stderr.length < 2048) child.stderr += chunk.toString("utf8")
    })
    spawned.once("error", (cause) => fail(`cannot start the file operation: ${cause.message}`, cause))
    spawned.once("close", (code, signal) => {
      const how = signal !== null ? `killed by ${signal}` : `exit ${code}`
      const stderr = child.stderr.trim()
      fail(`the file operation failed (${how})${stderr === "" ? "" : `: ${stderr.slice(0, 500)}`}`)
    })
    return Either.right(child)
  }

  /** the child's stdout: each complete line answers the pending request */
  private receive(child: Child, chunk: Buffer, fail: (message: string, cause?: unknown) => void): void {
    let rest = chunk
    for (;;) {
      const pending = child.pending
      const newline = rest.indexOf(10)
      const piece = newline < 0 ? rest : rest.subarray(0, newline)
      child.size += piece.length
      if (pending === undefined || child.size > pending.bound) {
        fail(
          pending === undefined
            ? "the file operation's child spoke out of turn"
            : "the file operation's reply is over its bound"
        )
        return
      }
      child.chunks.push(piece)
      if (newline < 0) return
      const line = Buffer.concat(child.chunks).toString("utf8")
      child.chunks = []
      child.size = 0
      child.pending = undefined
      const reply = decodeReply(line)
      if (Either.isLeft(reply) || reply.right.id !== pending.id) {
        child.pending = pending
        fail(
          "the file operation's child sent a malformed reply",
          Either.isLeft(reply) ? reply.left : undefined
        )
        return
      }
      const value = reply.right
      pending.resume(
        value.ok
          ? Effect.succeed(Buffer.from(value.data ?? "", "base64"))
          : Effect.fail(new FileOpError({ message: value.error }))
      )
      rest = rest.subarray(newline + 1)
      if (rest.length === 0) return
    }
  }
}
