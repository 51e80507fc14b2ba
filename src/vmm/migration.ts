/**
 * QEMU memory snapshots: a running VM's memory and device state saved to a file over QMP, and a
 * VM started from one (docs/on-disk.md "State files"). Generic: a QMP socket and a path in, a
 * path out; the programs decide where state files live and when they are used.
 *
 * - Save: raise max-bandwidth (the default 128 MiB/s cap makes a save 4x slower), `stop`,
 *   `migrate exec:<zstd -1 | sparse dd> > state` (QEMU 7.2 has no `file:` URI), poll
 *   `query-migrate` until completed, then `quit` (suspend) or `cont` (fork of a running VM: a
 *   second migrate fails until the VM ran again).
 * - Restore: the same argv with the machine type the state was saved under and
 *   `-incoming defer`, then `migrate-incoming exec:<zstd -dc | cat> state`, poll, `cont`.
 * - The manifest beside the state records what the state only fits: the QEMU version, the
 *   pinned machine type, a digest of the device layout (the argv with paths left out), -m and
 *   the image. `checkManifest` refuses a restore on any difference (StateMismatch); the
 *   session then cold-boots from its disks.
 */
import * as Data from "effect/Data"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Schedule from "effect/Schedule"
import * as Schema from "effect/Schema"
// Raw node:child_process / node:fs / node:crypto: `qemu --version` once, a digest, the state file's mode and size.
import { execFileSync } from "node:child_process"
import * as crypto from "node:crypto"
import * as fs from "node:fs"
import { errorMessage } from "../domain/errorMessage.js"
import { type StateCompression, StateManifest, StateMismatch } from "../domain/memoryState.js"
import { findExecutable } from "../lib/executable.js"
import { buildQemuArgv, type QemuArgvInput } from "./argv.js"
import { type QmpClient, qmpConnect } from "./qmp.js"

/** a save or restore over QMP failed (the VM is left as QEMU left it: the caller closes it) */
export class MigrationFailed extends Data.TaggedError("MigrationFailed")<{
  readonly step: string
  readonly message: string
  readonly cause?: unknown
}> {}

const decodeManifest = Schema.decodeUnknown(Schema.parseJson(StateManifest))

const failed = (step: string) => (cause: unknown) =>
  new MigrationFailed({ step, message: `${step}: ${errorMessage(cause)}`, cause })

/** a word for `sh -c` (QEMU runs an exec: URI through /bin/sh) */
export const shellQuote = (word: string): string => `'${word.replaceAll("'", `'\\''`)}'`

/** zstd when it is installed (scripts/setup.sh installs it), else raw */
export const defaultCompression = (): StateCompression =>
  findExecutable("zstd") === undefined ? "raw" : "zstd"

/** the exec: URI QEMU writes a state into */
export const saveUri = (statePath: string, compression: StateCompression): string =>
  compression === "zstd"
    ? `exec:zstd -1 -q -T1 -c > ${shellQuote(statePath)}`
    : `exec:dd of=${shellQuote(statePath)} bs=1M iflag=fullblock conv=sparse,notrunc status=none`

/** the exec: URI QEMU reads a state from */
export const loadUri = (statePath: string, compression: StateCompression): string =>
  compression === "zstd" ? `exec:zstd -dcq ${shellQuote(statePath)}` : `exec:cat ${shellQuote(statePath)}`

/** the first line of `<qemu> --version` */
export const qemuVersion = (qemu: string): Effect.Effect<string, MigrationFailed> =>
  Effect.try({
    try: () =>
      execFileSync(qemu, ["--version"], { encoding: "utf8", timeout: 10_000 }).split("\n")[0]!.trim(),
    catch: failed("qemu --version")
  })

/** what the device layout depends on: the argv input without its paths */
export type LayoutInput = Omit<
  QemuArgvInput,
  "kernel" | "initrd" | "rootDisk" | "configDisk" | "rpcSocket" | "qmpSocket" | "repoDisks" | "incoming"
> & { readonly repoDisks?: { readonly repoFormat: string } | undefined }

/**
 * sha256 of the argv built from `input` with every path a placeholder: two VMs whose digests are
 * equal have the same devices in the same slots, the same memory, CPUs, machine and kernel line
 */
export const layoutDigest = (input: LayoutInput): string => {
  const argv = buildQemuArgv({
    ...input,
    kernel: "K",
    initrd: "I",
    rootDisk: "R",
    configDisk: "C",
    rpcSocket: "S",
    qmpSocket: "Q",
    // the warm layout's disks, plugged in after a restore or on the argv of a later one: one layout
    plugged: false,
    repoDisks:
      input.repoDisks === undefined
        ? undefined
        : { repo: "P", repoFormat: input.repoDisks.repoFormat === "raw" ? "raw" : "qcow2", base: "B" }
  })
  return crypto.createHash("sha256").update(argv.join("\0")).digest("hex")
}

const MigrateStatus = Schema.Struct({
  status: Schema.optional(Schema.String),
  "error-desc": Schema.optional(Schema.String)
})
const decodeStatus = Schema.decodeUnknown(MigrateStatus)

/** poll `query-migrate` until completed (failed or cancelled: MigrationFailed), within `timeout` */
const awaitMigration = (qmp: QmpClient, step: string, timeout: Duration.DurationInput) =>
  Effect.tryPromise({ try: () => qmp.execute("query-migrate"), catch: failed(step) }).pipe(
    Effect.flatMap((value) => decodeStatus(value).pipe(Effect.mapError(failed(step)))),
    Effect.flatMap((info) =>
      info.status === "failed" || info.status === "cancelled"
        ? Effect.fail(
            new MigrationFailed({
              step,
              message: `${step}: ${info.status}: ${info["error-desc"] ?? "no reason given"}`
            })
          )
        : Effect.succeed(info.status)
    ),
    Effect.repeat({ until: (status) => status === "completed", schedule: Schedule.spaced("20 millis") }),
    Effect.timeoutFail({
      duration: timeout,
      onTimeout: () =>
        new MigrationFailed({ step, message: `${step}: not complete within ${Duration.format(timeout)}` })
    }),
    Effect.asVoid
  )

/** a scoped QMP connection */
const connectQmp = (qmpSocket: string, step: string) =>
  Effect.acquireRelease(Effect.tryPromise({ try: () => qmpConnect(qmpSocket), catch: failed(step) }), (qmp) =>
    Effect.sync(() => qmp.close())
  )

const run = (qmp: QmpClient, step: string, command: string, args?: Record<string, unknown>) =>
  Effect.tryPromise({ try: () => qmp.execute(command, args), catch: failed(step) })

/** the versioned machine type `alias` (q35, virt) stands for in this QEMU (`query-machines`) */
export const resolveMachine = (qmp: QmpClient, alias: string) =>
  run(qmp, "query-machines", "query-machines").pipe(
    Effect.flatMap((value) =>
      Schema.decodeUnknown(
        Schema.Array(Schema.Struct({ name: Schema.String, alias: Schema.optional(Schema.String) }))
      )(value).pipe(Effect.mapError(failed("query-machines")))
    ),
    Effect.map((machines) => machines.find((m) => m.alias === alias)?.name ?? alias)
  )

/** QEMU's id of each drive argv.ts attaches: the root disk is the first `if=virtio` drive */
export const DRIVE_IDS = { root: "virtio0", repo: "repo" } as const

/**
 * Each drive goes on writing into an overlay made beforehand (`blockdev-snapshot-sync`, mode
 * `existing`: the overlay names its backing file itself, src/lib/frozenLayers.ts). QEMU keeps
 * the file names it opened and opens them again (a migration's end inactivates the drives), so
 * neither file may be renamed while this QEMU runs.
 */
export const snapshotDrives = (
  qmp: QmpClient,
  drives: ReadonlyArray<{ readonly drive: keyof typeof DRIVE_IDS; readonly overlay: string }>
) =>
  Effect.forEach(
    drives,
    ({ drive, overlay }) =>
      run(qmp, `snapshot ${drive}`, "blockdev-snapshot-sync", {
        device: DRIVE_IDS[drive],
        "snapshot-file": overlay,
        format: "qcow2",
        mode: "existing"
      }),
    { discard: true }
  )

export interface SaveOptions {
  readonly qmpSocket: string
  readonly statePath: string
  readonly compression?: StateCompression | undefined
  /** after the save: `quit` ends QEMU (suspend), `cont` runs the VM on (fork of a running VM) */
  readonly then: "quit" | "cont"
  /** runs while the VM is stopped, before the state is written (fork: `blockdev-snapshot-sync`) */
  readonly whileStopped?: ((qmp: QmpClient) => Effect.Effect<void, MigrationFailed>) | undefined
  /** the machine family argv.ts starts (q35 / virt), resolved to the versioned type */
  readonly machineAlias: string
  readonly timeout?: Duration.DurationInput | undefined
}

export interface SavedState {
  readonly machine: string
  readonly compression: StateCompression
  /** the state file's size on disk (allocated blocks) */
  readonly bytes: number
  readonly millis: number
}

/** bytes a file takes on disk (its allocated blocks: a sparse file counts what it holds) */
export const diskBytes = (file: string): number => {
  const stat = fs.statSync(file)
  return Math.min(stat.size, stat.blocks * 512)
}

/**
 * Save the VM's memory and device state into `statePath` (created 0600 before QEMU writes it;
 * a failed save removes it). The VM is stopped first; `then` says how it ends.
 */
export const saveState = Effect.fn("Migration.save")(function* (options: SaveOptions) {
  const compression = options.compression ?? defaultCompression()
  const timeout = options.timeout ?? Duration.minutes(5)
  const started = Date.now()
  const result = yield* Effect.scoped(
    Effect.gen(function* () {
      const qmp = yield* connectQmp(options.qmpSocket, "connect")
      const machine = yield* resolveMachine(qmp, options.machineAlias)
      yield* Effect.try({
        try: () => {
          fs.rmSync(options.statePath, { force: true })
          fs.closeSync(fs.openSync(options.statePath, "wx", 0o600))
          fs.chmodSync(options.statePath, 0o600)
        },
        catch: failed("create the state file")
      })
      yield* run(qmp, "migrate-set-parameters", "migrate-set-parameters", { "max-bandwidth": 17179869184 })
      yield* run(qmp, "stop", "stop")
      if (options.whileStopped !== undefined) yield* options.whileStopped(qmp)
      yield* run(qmp, "migrate", "migrate", { uri: saveUri(options.statePath, compression) })
      yield* awaitMigration(qmp, "migrate", timeout)
      if (options.then === "cont") yield* run(qmp, "cont", "cont")
      else
        yield* Effect.tryPromise({ try: () => qmp.execute("quit"), catch: failed("quit") }).pipe(
          Effect.ignore
        )
      return machine
    })
  ).pipe(Effect.tapError(() => Effect.sync(() => fs.rmSync(options.statePath, { force: true }))))
  return {
    machine: result,
    compression,
    bytes: diskBytes(options.statePath),
    millis: Date.now() - started
  } satisfies SavedState
})

export interface RestoreOptions {
  /** the QMP socket of a QEMU started with `-incoming defer` (argv.ts `incoming`) */
  readonly qmpSocket: string
  readonly statePath: string
  readonly compression: StateCompression
  /** bound on QEMU's QMP socket appearing (it is created during QEMU's start) */
  readonly connectTimeout?: Duration.DurationInput | undefined
  readonly timeout?: Duration.DurationInput | undefined
  /** how long QEMU has had to start: polls the socket (QEMU gives no other sign) */
  readonly qemuExited?: Effect.Effect<boolean> | undefined
}

/** load the state into a QEMU waiting for it (`-incoming defer`), then run the VM (`cont`) */
export const restoreState = Effect.fn("Migration.restore")(function* (options: RestoreOptions) {
  const connectTimeout = options.connectTimeout ?? Duration.seconds(30)
  const timeout = options.timeout ?? Duration.minutes(5)
  yield* Effect.scoped(
    Effect.gen(function* () {
      const qmp = yield* connectQmp(options.qmpSocket, "connect").pipe(
        Effect.retry({
          schedule: Schedule.spaced("10 millis"),
          while: () => Effect.map(options.qemuExited ?? Effect.succeed(false), (gone) => !gone)
        }),
        Effect.timeoutFail({
          duration: connectTimeout,
          onTimeout: () =>
            new MigrationFailed({
              step: "connect",
              message: `QMP did not answer within ${Duration.format(connectTimeout)}`
            })
        })
      )
      yield* run(qmp, "migrate-incoming", "migrate-incoming", {
        uri: loadUri(options.statePath, options.compression)
      })
      yield* awaitMigration(qmp, "migrate-incoming", timeout)
      yield* run(qmp, "cont", "cont")
    })
  )
})

/** the manifest of a state file, decoded; a file that does not decode is a StateMismatch */
export const readManifest = (file: string): Effect.Effect<StateManifest, StateMismatch> =>
  Effect.try({ try: () => fs.readFileSync(file, "utf8"), catch: (cause) => cause }).pipe(
    Effect.flatMap((text) => decodeManifest(text)),
    Effect.mapError(
      (cause) =>
        new StateMismatch({
          field: "manifest",
          message: `${file} cannot be read: ${errorMessage(cause).split("\n")[0]}`
        })
    )
  )

export interface StateExpectation {
  readonly qemuVersion: string
  /** the layout digest of the VM about to start, with the manifest's machine type */
  readonly layoutDigest: string
  readonly memoryMiB: number
  readonly cpus: number
  readonly imageDigest: string
}

/** a state fits a VM only when all of these are equal; the first difference is the error */
export const checkManifest = (
  manifest: StateManifest,
  expected: StateExpectation
): Effect.Effect<void, StateMismatch> => {
  const fields = [
    ["qemuVersion", "QEMU"],
    ["imageDigest", "image"],
    ["memoryMiB", "memory (MiB)"],
    ["cpus", "CPUs"],
    ["layoutDigest", "device layout"]
  ] as const
  for (const [field, what] of fields) {
    if (manifest[field] !== expected[field]) {
      return Effect.fail(
        new StateMismatch({
          field,
          message: `the saved memory state does not fit this VM: ${what} was ${String(manifest[field])}, is ${String(expected[field])}`
        })
      )
    }
  }
  return Effect.void
}

/** the repository disks a warm restore plugs in: the files, and the hot-plug slots (argv.ts) */
export interface PluggedRepoDisks {
  readonly repo: string
  readonly repoFormat: "qcow2" | "raw"
  readonly base: string
  readonly ports: { readonly repo: string; readonly base: string }
}

/**
 * Hot-plugs the session's repository disks into a running VM of the warm layout: each file a
 * block node (`blockdev-add`; the repository's node is named DRIVE_IDS.repo, as its `-drive` is
 * in a cold boot, so that `snapshotDrives` finds it), then a virtio-blk device on its free slot
 * with the serial the guest looks for (src/guest/repoDisk.ts), as the cold argv attaches them.
 */
export const plugRepoDisks = Effect.fn("Migration.plugRepoDisks")(function* (
  qmpSocket: string,
  disks: PluggedRepoDisks
) {
  yield* Effect.scoped(
    Effect.gen(function* () {
      const qmp = yield* connectQmp(qmpSocket, "connect")
      yield* run(qmp, "blockdev-add base", "blockdev-add", {
        driver: "raw",
        "node-name": "base",
        "read-only": true,
        file: { driver: "file", filename: disks.base }
      })
      yield* run(qmp, "blockdev-add repo", "blockdev-add", {
        driver: disks.repoFormat,
        "node-name": DRIVE_IDS.repo,
        discard: "unmap",
        file: { driver: "file", filename: disks.repo }
      })
      yield* run(qmp, "device_add repo", "device_add", {
        driver: "virtio-blk-pci",
        id: "abox-repo",
        drive: DRIVE_IDS.repo,
        serial: "abox-repo",
        bus: disks.ports.repo
      })
      yield* run(qmp, "device_add base", "device_add", {
        driver: "virtio-blk-pci",
        id: "abox-base",
        drive: "base",
        serial: "abox-base",
        bus: disks.ports.base
      })
    })
  )
})
