/**
 * vfkit (Virtualization.framework on macOS): the command line of a session VM and a small client
 * of vfkit's RESTful API over its unix socket. Flag and API references are vfkit's own
 * documentation, `doc/usage.md` in github.com/crc-org/vfkit (0.6.0 or newer: `readonly` on
 * virtio-blk appeared there).
 */
import * as Data from "effect/Data"
import type * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Schema from "effect/Schema"
// Raw node:fs / node:zlib: the kernel is chosen (and, for an old image, decompressed once)
// synchronously, before the VMM starts. The REST client itself is plain node (./vfkitRest.ts),
// shared with the abox-vmm helper, which carries no Effect runtime.
import * as fs from "node:fs"
import * as path from "node:path"
import * as zlib from "node:zlib"
import { KERNEL_IMAGE_FILE } from "../domain/sessionLayout.js"
import type { RepoDisks } from "../domain/vm.js"
import { errorMessage } from "../domain/errorMessage.js"
import { vfkitRequest } from "./vfkitRest.js"

/** the guest connects to this vsock port; vfkit proxies it to the host's rpc.sock */
export const RPC_VSOCK_PORT = 1024

export interface VfkitArgvInput {
  readonly kernel: string
  readonly initrd: string
  readonly rootDisk: string
  readonly configDisk: string
  /** the host end of the guest RPC channel: GuestRpc listens on it before vfkit starts */
  readonly rpcSocket: string
  /** the RESTful API socket vfkit creates (graceful stop, state) */
  readonly restSocket: string
  readonly consoleLog: string
  readonly cpus: number
  readonly memoryMiB: number
  readonly kernelArgs?: ReadonlyArray<string> | undefined
  /** the repository disks (raw: vfkit attaches raw images only) */
  readonly repoDisks?: RepoDisks | undefined
}

export class VfkitPathError extends Data.TaggedError("VfkitPathError")<{
  readonly path: string
  readonly reason: string
}> {
  override get message() {
    return `vfkit cannot be given ${this.path}: ${this.reason}`
  }
}

/**
 * vfkit splits a `--device` value on every comma with no escape (pkg/config/virtio.go,
 * `deviceFromCmdLine`), and the vsock socketURL and the REST URI go through a URL parser: a
 * path with a comma (or `%`, `?`, `#` where it becomes a URL) cannot be expressed at all, so it
 * is refused up front rather than misread.
 */
export const checkVfkitPath = (file: string, asUrl = false): Either.Either<string, VfkitPathError> => {
  if (!path.isAbsolute(file))
    return Either.left(new VfkitPathError({ path: file, reason: "not an absolute path" }))
  if (file.includes(","))
    return Either.left(new VfkitPathError({ path: file, reason: "vfkit options cannot hold a comma" }))
  if (asUrl && /[%?#]/.test(file))
    return Either.left(new VfkitPathError({ path: file, reason: "a socket URL cannot hold %, ? or #" }))
  return Either.right(file)
}

/** the kernel command line: the virtio console is hvc0 under Virtualization.framework */
export const vfkitKernelCmdline = (kernelArgs: ReadonlyArray<string> = []): string =>
  ["console=hvc0", "quiet", "panic=-1", ...kernelArgs].join(" ")

/**
 * The vfkit command line of a session VM: direct kernel boot, root rw and config read-only on
 * virtio-blk (vda, vdb in this order), the serial console into console.log, an entropy device,
 * the RPC channel as vsock port 1024 and the RESTful API on a unix socket. No network device:
 * the guest reaches the outside only through the broker's tunnels over the RPC channel.
 *
 * - `--kernel/--initrd/--kernel-cmdline` rather than `--bootloader linux,...`: they are still
 *   accepted, and the command line would otherwise be one more comma-split, quoted option.
 * - `virtio-vsock,...,listen`: vfkit listens on the guest's vsock port and, for each guest
 *   connection, dials the host unix socket (`listenVsock` in pkg/vf/vsock.go; `listen` is the
 *   default, written out so that a change of default cannot flip it). `connect` is the opposite
 *   direction (the host dials the guest) and is not what GuestRpc expects.
 * - `readonly` on the config disk: Virtualization.framework opens the image read-only and the
 *   guest sees a read-only device (VIRTIO_BLK_F_RO); the guest also mounts it read-only.
 * - `--restful-uri unix:///abs/path`: the URI must have an empty host (pkg/rest/rest.go).
 */
export const buildVfkitArgv = (input: VfkitArgvInput): Either.Either<Array<string>, VfkitPathError> =>
  Either.gen(function* () {
    const kernel = yield* checkVfkitPath(input.kernel)
    const initrd = yield* checkVfkitPath(input.initrd)
    const root = yield* checkVfkitPath(input.rootDisk)
    const config = yield* checkVfkitPath(input.configDisk)
    const consoleLog = yield* checkVfkitPath(input.consoleLog)
    const rpc = yield* checkVfkitPath(input.rpcSocket, true)
    const rest = yield* checkVfkitPath(input.restSocket, true)
    const repoDisks: Array<string> = []
    if (input.repoDisks !== undefined) {
      if (input.repoDisks.repoFormat !== "raw") {
        return yield* Either.left(
          new VfkitPathError({ path: input.repoDisks.repo, reason: "vfkit attaches raw disk images only" })
        )
      }
      const repo = yield* checkVfkitPath(input.repoDisks.repo)
      const base = yield* checkVfkitPath(input.repoDisks.base)
      // deviceId: the virtio serial the guest finds each disk by
      repoDisks.push(
        "--device",
        `virtio-blk,path=${repo},deviceId=abox-repo`,
        "--device",
        `virtio-blk,path=${base},readonly,deviceId=abox-base`
      )
    }
    return [
      "--cpus",
      String(input.cpus),
      "--memory",
      String(input.memoryMiB),
      "--kernel",
      kernel,
      "--initrd",
      initrd,
      "--kernel-cmdline",
      vfkitKernelCmdline(input.kernelArgs),
      "--device",
      `virtio-blk,path=${root}`,
      "--device",
      `virtio-blk,path=${config},readonly`,
      ...repoDisks,
      "--device",
      `virtio-serial,logFilePath=${consoleLog}`,
      "--device",
      "virtio-rng",
      "--device",
      `virtio-vsock,port=${RPC_VSOCK_PORT},socketURL=${rpc},listen`,
      "--restful-uri",
      `unix://${rest}`
    ]
  })

// ---- kernel ----------------------------------------------------------------------------------

export class KernelError extends Data.TaggedError("KernelError")<{
  readonly path: string
  readonly reason: string
}> {
  override get message() {
    return `kernel ${this.path}: ${this.reason}`
  }
}

const isGzip = (file: string): boolean => {
  const fd = fs.openSync(file, "r")
  try {
    const head = Buffer.alloc(2)
    return fs.readSync(fd, head, 0, 2, 0) === 2 && head[0] === 0x1f && head[1] === 0x8b
  } finally {
    fs.closeSync(fd)
  }
}

/**
 * The uncompressed kernel an aarch64 image ships beside `vmlinuz` (images/build-small.sh; the
 * registry records it as `files.kernelImage`; src/domain/sessionLayout.ts names it)
 */
export const SHIPPED_KERNEL_IMAGE = KERNEL_IMAGE_FILE

/**
 * Virtualization.framework boots only an uncompressed arm64 `Image` ("the kernel must be
 * uncompressed or the VM will hang", vfkit's usage.md). In order:
 * - the image's own uncompressed `Image` beside `kernel` (shipped by the image build);
 * - an uncompressed `kernel`, as it is (Debian 12's arm64 vmlinuz is one; other kernels are
 *   gzipped);
 * - otherwise (images built before `Image` was shipped) the gzipped kernel is decompressed once
 *   into `<kernel>.Image` next to it (atomically: temp file, rename), or into `fallbackDir` when
 *   the image directory is not writable.
 */
export const uncompressedKernel = (kernel: string, fallbackDir: string) =>
  Effect.try({
    try: () => {
      const stat = fs.statSync(kernel) // the image's kernel must be there, whichever file boots
      const shipped = path.join(path.dirname(kernel), SHIPPED_KERNEL_IMAGE)
      if (fs.statSync(shipped, { throwIfNoEntry: false })?.isFile() === true && !isGzip(shipped))
        return shipped
      if (!isGzip(kernel)) return kernel
      const candidates = [`${kernel}.Image`, path.join(fallbackDir, "kernel.Image")]
      for (const target of candidates) {
        const existing = fs.statSync(target, { throwIfNoEntry: false })
        if (existing !== undefined && existing.mtimeMs >= stat.mtimeMs) return target
      }
      const image = zlib.gunzipSync(fs.readFileSync(kernel))
      for (const target of candidates) {
        const temp = `${target}.${process.pid}.tmp`
        try {
          fs.writeFileSync(temp, image, { mode: 0o644 })
          fs.renameSync(temp, target)
          return target
        } catch {
          fs.rmSync(temp, { force: true })
        }
      }
      throw new Error(`cannot write the uncompressed kernel to ${candidates.join(" or ")}`)
    },
    catch: (cause) => new KernelError({ path: kernel, reason: errorMessage(cause) })
  })

// ---- RESTful API -----------------------------------------------------------------------------

/** `GET /vm/state` (vfkit usage.md, "RESTful API") */
export const VfkitState = Schema.Struct({
  state: Schema.String,
  canStart: Schema.optional(Schema.Boolean),
  canPause: Schema.optional(Schema.Boolean),
  canResume: Schema.optional(Schema.Boolean),
  canStop: Schema.optional(Schema.Boolean),
  canHardStop: Schema.optional(Schema.Boolean)
})
export type VfkitState = typeof VfkitState.Type
const decodeState = Schema.decodeUnknownEither(Schema.parseJson(VfkitState))

/** `POST /vm/state {"state": ...}`: Stop asks the guest (RequestStop), HardStop pulls the plug */
export type VfkitStateChange = "Stop" | "HardStop" | "Pause" | "Resume"

export class VfkitRestError extends Data.TaggedError("VfkitRestError")<{
  readonly socket: string
  readonly reason: string
  readonly cause?: unknown
}> {
  override get message() {
    return `vfkit REST (${this.socket}): ${this.reason}`
  }
}

const request = (
  socket: string,
  method: "GET" | "POST",
  route: string,
  body: string | undefined,
  timeout: Duration.DurationInput
) =>
  Effect.tryPromise({
    try: (signal) => vfkitRequest({ socket, method, route, body, signal }),
    catch: (cause) => new VfkitRestError({ socket, reason: errorMessage(cause), cause })
  }).pipe(
    Effect.timeoutFail({
      duration: timeout,
      onTimeout: () => new VfkitRestError({ socket, reason: `${method} ${route}: no answer in time` })
    })
  )

/** the VM's state as vfkit reports it */
export const vfkitGetState = (socket: string, timeout: Duration.DurationInput = "2 seconds") =>
  request(socket, "GET", "/vm/state", undefined, timeout).pipe(
    Effect.flatMap((res) => {
      if (res.status !== 200)
        return Effect.fail(new VfkitRestError({ socket, reason: `GET /vm/state: HTTP ${res.status}` }))
      const decoded = decodeState(res.body)
      return Either.isRight(decoded)
        ? Effect.succeed(decoded.right)
        : Effect.fail(
            new VfkitRestError({
              socket,
              reason: `GET /vm/state: unexpected answer ${res.body.slice(0, 200)}`
            })
          )
    })
  )

/** ask vfkit to change the VM's state; success = HTTP 2xx */
export const vfkitSetState = (
  socket: string,
  state: VfkitStateChange,
  timeout: Duration.DurationInput = "2 seconds"
) =>
  request(socket, "POST", "/vm/state", JSON.stringify({ state }), timeout).pipe(
    Effect.flatMap((res) =>
      res.status >= 200 && res.status < 300
        ? Effect.void
        : Effect.fail(
            new VfkitRestError({
              socket,
              reason: `POST /vm/state ${state}: HTTP ${res.status} ${res.body.slice(0, 200)}`
            })
          )
    )
  )
