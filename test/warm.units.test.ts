/**
 * Warm snapshots without a VM: the warm argv layout (no config or repository disk, the guest told
 * to wait, the state restored by -incoming through a shell-quoted path), and what makes a saved
 * state unusable (its manifest against this host's inputs).
 */
import { describe, expect, it } from "@effect/vitest"
import { buildQemuArgv, type QemuArgvInput } from "../src/vmm/argv.js"
import { manifestMismatch, warmKey } from "../src/vmm/warmSnapshot.js"
import { WARM_MANIFEST_FORMAT, type WarmInputs, type WarmManifest } from "../src/domain/warm.js"

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
  it("the warm argv has no config or repository disk, tells the guest to wait, restores through a quoted path", () => {
    const cold = buildQemuArgv(input)
    expect(cold.join(" ")).toContain("config.raw")
    expect(cold).not.toContain("-incoming")
    const warm = buildQemuArgv({ ...input, warm: { incoming: "/h/it's state" } })
    const text = warm.join(" ")
    expect(text).not.toContain("config.raw")
    expect(text).not.toContain("repo.qcow2")
    expect(warm[warm.indexOf("-append") + 1]).toContain("abox.session=wait")
    expect(warm.slice(-2)).toEqual(["-incoming", `exec:cat '/h/it'\\''s state'`])
    // the snapshot's boot and its restores differ only by -incoming
    expect(buildQemuArgv({ ...input, warm: {} })).toEqual(warm.slice(0, -2))
  })

  it("a manifest of another QEMU, memory, CPUs, layout or image is refused with the reason", () => {
    const inputs: WarmInputs = {
      imageDigest: "d1",
      qemuVersion: "QEMU emulator version 7.2.22",
      layout: ["-m", "1024"],
      cpus: 2,
      memoryMiB: 1024
    }
    const manifest: WarmManifest = {
      format: WARM_MANIFEST_FORMAT,
      key: warmKey(inputs),
      ...inputs,
      stateBytes: 10
    }
    expect(manifestMismatch(manifest, inputs)).toBeUndefined()
    const cases: ReadonlyArray<[Partial<WarmInputs>, string]> = [
      [{ qemuVersion: "QEMU emulator version 8.0" }, "saved by QEMU"],
      [{ memoryMiB: 2048 }, "MiB"],
      [{ cpus: 4 }, "CPUs"],
      [{ layout: ["-m", "2048"] }, "layout"],
      [{ imageDigest: "d2" }, "image"]
    ]
    for (const [change, reason] of cases) {
      const other = { ...inputs, ...change }
      expect(warmKey(other)).not.toBe(manifest.key)
      expect(manifestMismatch(manifest, other)).toContain(reason)
      // a manifest edited to claim the other inputs no longer matches its own key
      expect(manifestMismatch({ ...manifest, ...change }, other)).toContain("key")
    }
  })
})
