import * as path from "node:path"

/**
 * Every file and directory abox keeps, by name: the one home of the on-disk layout
 * (docs/on-disk.md). Code that needs one of these paths builds it from here; no other module
 * spells these names.
 */

/** `$ABOX_HOME/…` (default `~/.abox`) */
export const HOME_FILES = {
  sessions: "sessions",
  names: "names",
  images: "images",
  /** downloaded packages for image builds, and the accelerator record */
  cache: "cache",
  /** detached supervisors' output, appended */
  supervisorLog: "supervisor.log",
  /** the logs of the last Open that failed (console.log, vfkit.log), replaced by the next one */
  failedOpen: "failed-open",
  /** the default HTTPS broker policy (written by the user; optional) */
  brokerPolicy: "broker.json",
  /** model catalog additions and overrides (written by the user; optional) */
  modelCatalog: "models.json",
  /** the secret scrubber's record of files found clean */
  scrubCache: "scrub-cache.json"
} as const

export type HomeFile = keyof typeof HOME_FILES

/** `$ABOX_HOME/cache/…` */
export const CACHE_FILES = {
  /** the QEMU accelerator chosen for this host boot and QEMU binary */
  accel: "accel.json"
} as const

/** the legacy home's sessions (older macOS versions of ABox), under the user's home directory */
export const LEGACY_SESSIONS = ["Library", "Application Support", "ABox", "sessions"] as const

/** `sessions/<id>/…`: the files of one session (docs/on-disk.md "Files of a session") */
export const SESSION_FILES = {
  /** host metadata (SessionMeta) */
  meta: "session.json",
  /** the host's copy of config.raw */
  guestConfig: "guest-config.json",
  /** the sealed config disk (/dev/vdb) */
  configDisk: "config.raw",
  /** the guest's root disk (/dev/vda) where it is raw: a clone or copy of the golden image */
  rootDisk: "root.raw",
  /** the guest's root disk (/dev/vda) as a qcow2 overlay of the golden's root.raw (QEMU) */
  rootQcow2: "root.qcow2",
  /** a standalone session's own kernel and initrd (`abox image rm --force` copied them) */
  kernel: "vmlinuz",
  initrd: "initrd.gz",
  /** ... and the uncompressed kernel, where its image had one (aarch64) */
  kernelImage: "Image",
  /** the snapshot as an ext4 disk: the baseline */
  repoBase: "repo-base.raw",
  /** the guest's /work/repo: an overlay of repo-base.raw (QEMU) */
  repoQcow2: "repo.qcow2",
  /** the guest's /work/repo: a clone of repo-base.raw (vfkit) */
  repoRaw: "repo.raw",
  /** the CLI's interactive log */
  transcript: "transcript.json",
  /** the guest's serial console */
  consoleLog: "console.log",
  /** HTTPS broker decisions (rotated to `broker.log.1`) */
  brokerLog: "broker.log",
  /** host end of the guest RPC channel (unix socket) */
  rpcSocket: "rpc.sock",
  /** a detached session's control socket */
  controlSocket: "control.sock",
  /** a detached session's forwarded environment ports (ForwardsFile), while its supervisor runs */
  forwards: "forwards.json",
  /** QEMU's control socket */
  qmpSocket: "qmp.sock",
  /** vfkit's REST socket (macOS) */
  vfkitSocket: "vfkit.sock",
  /** vfkit's own output (macOS) */
  vfkitLog: "vfkit.log",
  /** a suspended session's memory and device state (QEMU migration stream, zstd or sparse raw) */
  memoryState: "memory.state",
  /** its manifest (StateManifest): written last, so a state without one is incomplete */
  memoryManifest: "memory.json",
  /** the runtime lock (flock / OFD lock) */
  lock: "lock"
} as const

export type SessionFile = keyof typeof SESSION_FILES

/** `<session dir>/<file>` */
export const sessionFile = (sessionDir: string, file: SessionFile): string =>
  path.join(sessionDir, SESSION_FILES[file])

/** a session directory being created (`sessions/.<id>.creating`), renamed into place when whole */
export const creatingDirName = (id: string): string => `.${id}.creating`

/** a session directory being removed (`sessions/.<id>.removing`) */
export const removingDirName = (id: string): string => `.${id}.removing`

/** `names/<stem>.json`, the binding of a name */
export const nameFileName = (stem: string): string => `${stem}.json`

/** `names/<stem>.json.lock`, beside each name file (never deleted) */
export const nameLockPath = (nameFile: string): string => `${nameFile}.lock`

/** `images/<name>/<digest>/…`: the three files whose digests make a golden image's digest */
export const IMAGE_FILES = { kernel: "vmlinuz", initrd: "initrd.gz", root: "root.raw" } as const

/** beside `vmlinuz`: the uncompressed kernel (aarch64 images; Virtualization.framework boots no other kind) */
export const KERNEL_IMAGE_FILE = "Image"

/**
 * `images/<name>/<digest>/warm/<key>/…`: a warm snapshot of the image (src/vmm/warmSnapshot.ts),
 * one directory per key (image digest, QEMU version, VM layout, memory, CPUs); made under
 * `warm/.<random>.building/` and renamed into place whole
 */
export const WARM_DIR = "warm"
export const WARM_FILES = {
  /** the VM's memory and device state (QEMU migration stream), 0600 */
  state: "state",
  /** the root overlay the snapshot's guest had mounted: each warm session starts from a copy */
  root: "root.qcow2",
  /** WarmManifest (src/domain/warm.ts) */
  manifest: "manifest.json",
  /** the snapshot boot's guest console */
  consoleLog: "console.log"
} as const

/** beside the image's files: its record (ImageJson) */
export const IMAGE_META_FILE = "image.json"

/** `images/default.json`: the default image's `{name, digest}` */
export const DEFAULT_IMAGE_FILE = "default.json"

/**
 * Where a session lives: the directory SessionStore found it in (the current home or the
 * legacy one). Code that acts on a session's files takes this, never an id it joins itself.
 */
export interface SessionLocation {
  readonly id: string
  readonly dir: string
  /** in the legacy home, which abox reads but never writes through SessionStore */
  readonly legacy: boolean
}
