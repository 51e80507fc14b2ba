/**
 * The session's repository disks (docs/on-disk.md, "Repository disks"): the host builds the
 * snapshot as an ext4 file system (`mkfs.ext4 -d`), the VM gets it as a
 * writable virtio disk (a copy-on-write overlay of it on QEMU) and the unchanged original as a
 * read-only one (`abox-base`). At every boot the agent mounts the first on the repository
 * directory and the second, read-only, on `<state>/baseline`: Open copies nothing inside the
 * guest, Resume finds the repository where it was, and `abox diff` compares against the baseline.
 *
 * Disks are found by their virtio serial numbers (`abox-repo`, `abox-base`), not by their order:
 * both hold the same file system (and label) until the guest writes.
 */
import { spawn } from "node:child_process"
import * as fs from "node:fs/promises"
import * as path from "node:path"

export const REPO_SERIAL = "abox-repo"
export const BASE_SERIAL = "abox-base"

/** a virtio disk's serial number (QEMU `serial=`, vfkit `deviceId=`), or undefined */
const readSerial = async (name: string): Promise<string | undefined> => {
  try {
    return (await fs.readFile(`/sys/block/${name}/serial`, "utf8")).trim()
  } catch {
    return undefined
  }
}

const run = (command: string, args: ReadonlyArray<string>): Promise<void> =>
  new Promise((resolve, reject) => {
    const child = spawn(command, args, { stdio: ["ignore", "ignore", "pipe"] })
    let stderr = ""
    child.stderr.on("data", (chunk: Buffer) => {
      stderr += chunk.toString("utf8")
    })
    child.once("error", reject)
    child.once("exit", (code) =>
      code === 0
        ? resolve()
        : reject(new Error(`${command} ${args.join(" ")}: ${stderr.trim() || `exit ${code}`}`))
    )
  })

/** the device nodes of the disks with the repository's and the baseline's serials */
const findRepoDisks = async (): Promise<{ repo?: string | undefined; base?: string | undefined }> => {
  let names: Array<string>
  try {
    names = (await fs.readdir("/sys/block")).filter((name) => /^vd[a-z]+$/.test(name))
  } catch {
    return {}
  }
  let repo: string | undefined
  let base: string | undefined
  for (const name of names.sort()) {
    const serial = await readSerial(name)
    if (serial === REPO_SERIAL) repo ??= `/dev/${name}`
    if (serial === BASE_SERIAL) base ??= `/dev/${name}`
  }
  return { repo, base }
}

export interface RepoDisks {
  /** the repository disk is mounted on the repository directory */
  readonly repo: boolean
  /** the baseline disk is mounted read-only on `<state>/baseline` */
  readonly baseline: boolean
}

/** the baseline tree: the mount point of the baseline disk, or the copy made after a tar transfer */
export const baselineDir = (stateDir: string): string => path.join(stateDir, "baseline")

/**
 * Mounts the session's virtio disks (root only; a fake guest passes `--repo-disks off`). A
 * repository disk that does not mount is an error (the session's work is on it); no disk at all
 * is the tar path (sessions made before repository disks, or backends without them).
 */
export const mountRepoDisks = async (
  repoDir: string,
  stateDir: string,
  /** an environment's setup VM: the repository is read, never written */
  readOnly = false,
  /**
   * a warm open: the host hot-plugged both disks just before the session came; the kernel
   * probes them while the agent starts, so they are looked for until this many ms have passed
   */
  hotplugWaitMs = 0
): Promise<RepoDisks> => {
  const deadline = Date.now() + hotplugWaitMs
  let { repo, base } = await findRepoDisks()
  while ((repo === undefined || base === undefined) && Date.now() < deadline) {
    await new Promise((resolve) => setTimeout(resolve, 10))
    ;({ repo, base } = await findRepoDisks())
  }
  if (hotplugWaitMs > 0 && (repo === undefined || base === undefined))
    throw new Error(`the hot-plugged repository disks did not appear within ${hotplugWaitMs} ms`)
  if (repo !== undefined) {
    // nosuid/nodev: the repository holds the user's files, never the guest's privileges;
    // noinit_itable: the kernel's lazy inode-table zeroing would write the whole table under TCG
    // discard: deletes free the host's blocks of the overlay (the drive has discard=unmap)
    await run("mount", [
      "-t",
      "ext4",
      "-o",
      readOnly ? "ro,noload,nosuid,nodev" : "noatime,nosuid,nodev,noinit_itable,discard",
      repo,
      repoDir
    ])
  }
  if (base !== undefined) {
    const dir = baselineDir(stateDir)
    await fs.mkdir(dir, { recursive: true, mode: 0o700 })
    await run("mount", ["-t", "ext4", "-o", "ro,noload,nosuid,nodev,noexec", base, dir])
  }
  return { repo: repo !== undefined, baseline: base !== undefined }
}
