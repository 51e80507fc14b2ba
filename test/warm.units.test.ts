/**
 * Warm snapshots without a VM: the warm argv layout (no config disk, no repository disk at start
 * but two free hot-plug slots, the guest told to wait), one layout digest for the snapshot's boot
 * and a session's restore, and a key per (image, QEMU, layout, memory, CPUs).
 */
import { describe, expect, it } from "@effect/vitest"
import { buildQemuArgv, type QemuArgvInput, WARM_HOTPLUG_PORTS } from "../src/vmm/argv.js"
import { layoutDigest } from "../src/vmm/migration.js"
import { warmKey } from "../src/programs/warm.js"
import type { WarmInputs } from "../src/domain/warm.js"

const input: QemuArgvInput = {
  arch: "x86_64",
  accel: "tcg",
  kernel: "/img/vmlinuz",
  initrd: "/img/initrd.gz",
  rootDisk: "/s/root.qcow2",
  rootDiskFormat: "qcow2",
  configDisk: "/s/config.raw",
  rpcSocket: "/s/rpc.sock",
  qmpSocket: "/s/qmp.sock",
  cpus: 2,
  memoryMiB: 1024,
  repoDisks: { repo: "/s/repo.qcow2", repoFormat: "qcow2", base: "/s/base.raw" }
}

describe("warm snapshot layout", () => {
  it("the warm argv has no config or repository disk but their hot-plug slots, and tells the guest to wait", () => {
    const cold = buildQemuArgv(input)
    expect(cold.join(" ")).toContain("config.raw")
    expect(cold.join(" ")).not.toContain("pcie-root-port")
    const warm = buildQemuArgv({ ...input, warm: true })
    const text = warm.join(" ")
    expect(text).not.toContain("config.raw")
    expect(text).not.toContain("repo.qcow2")
    expect(warm[warm.indexOf("-append") + 1]).toContain("abox.session=wait")
    for (const port of Object.values(WARM_HOTPLUG_PORTS)) expect(text).toContain(`pcie-root-port,id=${port},`)
    // a restore is the same argv, paused for its state
    const restore = buildQemuArgv({ ...input, warm: true, incoming: true, machine: "pc-q35-7.2" })
    expect(restore.slice(-2)).toEqual(["-incoming", "defer"])
  })

  it("the snapshot's boot (no repository disks) and a session's restore (with them) have one layout digest", () => {
    const { repoDisks: _none, ...bare } = input
    const snapshot = layoutDigest({ ...bare, warm: true, machine: "pc-q35-7.2" })
    expect(layoutDigest({ ...input, warm: true, machine: "pc-q35-7.2" })).toBe(snapshot)
    // the resume of a suspended warm session: the disks on the argv, in the slots they were plugged into
    const plugged = buildQemuArgv({ ...input, warm: true, plugged: true }).join(" ")
    expect(plugged).toContain(`serial=abox-repo,bus=${WARM_HOTPLUG_PORTS.repo}`)
    expect(plugged).toContain(`serial=abox-base,bus=${WARM_HOTPLUG_PORTS.base}`)
    expect(layoutDigest({ ...input, warm: true, plugged: true, machine: "pc-q35-7.2" })).toBe(snapshot)
    // a cold boot's layout is another: its state never restores into a warm VM, nor the reverse
    expect(layoutDigest({ ...input, machine: "pc-q35-7.2" })).not.toBe(snapshot)
  })

  it("another QEMU, memory, CPUs, layout or image is another snapshot", () => {
    const inputs: WarmInputs = {
      imageDigest: "d1",
      qemuVersion: "QEMU emulator version 7.2.22",
      layoutDigest: "L1",
      cpus: 2,
      memoryMiB: 1024
    }
    const changes: ReadonlyArray<Partial<WarmInputs>> = [
      { qemuVersion: "QEMU emulator version 8.0" },
      { memoryMiB: 2048 },
      { cpus: 4 },
      { layoutDigest: "L2" },
      { imageDigest: "d2" }
    ]
    for (const change of changes) expect(warmKey({ ...inputs, ...change })).not.toBe(warmKey(inputs))
    expect(warmKey({ ...inputs })).toBe(warmKey(inputs))
  })
})
