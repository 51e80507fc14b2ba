/**
 * `abox doctor --boot`, the built CLI against the busybox test image: on Linux it boots a
 * throwaway QEMU VM and reports each step; with ABOX_VMM=vz (the fake vfkit) the same image's
 * x86 kernel is what vfkit would refuse, and the report says so before anything boots.
 */
import { describe, expect, it } from "@effect/vitest"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { ensureTestImage, repoRoot, testHome, vmSkipReason } from "./e2e-vm-image.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`doctor --boot: skipped: ${skip}`)

interface Check {
  readonly name: string
  readonly status: "ok" | "warn" | "fail"
  readonly detail: string
}

const doctorBoot = (env: Record<string, string>) => {
  const r = spawnSync(
    process.execPath,
    [path.join(repoRoot, "dist", "abox.js"), "doctor", "--boot", "--json"],
    {
      env: { PATH: process.env.PATH ?? "", HOME: os.tmpdir(), ABOX_HOME: testHome, ...env },
      stdio: ["ignore", "pipe", "pipe"],
      encoding: "utf8",
      timeout: 240_000
    }
  )
  const checks = (JSON.parse(r.stdout) as { checks: Array<Check> }).checks
  return { code: r.status, checks, byName: (name: string) => checks.find((c) => c.name === name) }
}

describe.skipIf(skip !== undefined)("abox doctor --boot", () => {
  it("QEMU: boots the default image and reports kernel, disks, hello, entropy and console, each ok; nothing left behind", async () => {
    await ensureTestImage()
    const before = fs.readdirSync(os.tmpdir()).filter((f) => f.startsWith("abox-doctor-"))
    const r = doctorBoot({ ABOX_VMM: "qemu" })
    for (const name of ["backend", "image", "kernel", "disks", "hello", "entropy", "console"])
      expect(r.byName(name), `${name}: ${JSON.stringify(r.checks)}`).toMatchObject({ status: "ok" })
    expect(r.byName("hello")!.detail).toMatch(/protocol 4, x86_64/)
    // the QEMU backend attaches virtio-rng-pci, and the initrd loads its driver
    expect(r.byName("entropy")!.detail).toMatch(/the kernel's rng is virtio_rng/)
    expect(r.byName("console")!.detail).toContain("abox-initrd: console ready")
    expect(r.byName("boot")).toBeUndefined()
    expect(r.code).toBe(0)
    const after = fs.readdirSync(os.tmpdir()).filter((f) => f.startsWith("abox-doctor-"))
    expect(after.filter((f) => !before.includes(f))).toEqual([])
  }, 300_000)

  it("vz (the fake vfkit): vfkit found; the image's kernel is no arm64 Image, which vfkit refuses: fail, exit 1, no VM", async () => {
    await ensureTestImage()
    const r = doctorBoot({
      ABOX_VMM: "vz",
      ABOX_VFKIT: path.join(repoRoot, "test", "support", "fake-vfkit.mjs")
    })
    expect(r.byName("backend")!.detail).toMatch(/^vz/)
    expect(r.byName("vfkit")).toMatchObject({ status: "ok" })
    expect(r.byName("kernel")).toMatchObject({ status: "fail" })
    expect(r.byName("kernel")!.detail).toMatch(/no arm64 Image magic/)
    expect(r.byName("hello")).toBeUndefined()
    expect(r.code).toBe(1)
  }, 300_000)
})
