import { describe, expect, it } from "@effect/vitest"
import * as fc from "fast-check"
import { buildQemuArgv, escapeOptionValue, minimalEnv } from "../src/vmm/argv.js"

const input = {
  arch: "x86_64" as const,
  accel: "tcg" as const,
  kernel: "/img/vmlinuz",
  initrd: "/img/initrd.gz",
  rootDisk: "/s/root.raw",
  configDisk: "/s/config.raw",
  rpcSocket: "/s/rpc.sock",
  qmpSocket: "/s/qmp.sock",
  cpus: 3,
  memoryMiB: 1536
}

const valueOf = (argv: ReadonlyArray<string>, flag: string): Array<string> =>
  argv.flatMap((arg, i) => (arg === flag ? [argv[i + 1]!] : []))

describe("QEMU argv", () => {
  it("has no network device and no defaults", () => {
    const argv = buildQemuArgv(input)
    expect(argv).toContain("-nodefaults")
    expect(argv).toContain("-no-user-config")
    expect(argv.some((a) => /^-(nic|net|netdev)$/.test(a))).toBe(false)
    expect(valueOf(argv, "-device").some((d) => /net|e1000|rtl8139|vmxnet/.test(d))).toBe(false)
  })

  it("root rw, config read-only, rpc port named abox.rpc, serial and QMP wired, -smp/-m from the spec", () => {
    const argv = buildQemuArgv(input)
    const drives = valueOf(argv, "-drive")
    expect(drives).toEqual([
      "file=/s/root.raw,format=raw,if=virtio,cache=writeback,discard=unmap",
      "file=/s/config.raw,format=raw,if=virtio,readonly=on"
    ])
    expect(valueOf(argv, "-chardev")).toContain("socket,id=rpc,path=/s/rpc.sock")
    expect(valueOf(argv, "-device")).toContain("virtserialport,chardev=rpc,name=abox.rpc")
    expect(valueOf(argv, "-qmp")).toEqual(["unix:/s/qmp.sock,server=on,wait=off"])
    expect(valueOf(argv, "-smp")).toEqual(["3"])
    expect(valueOf(argv, "-m")).toEqual(["1536"])
    expect(valueOf(argv, "-machine")).toEqual(["q35,accel=tcg"])
    expect(valueOf(argv, "-append")[0]).toMatch(/^console=ttyS0 /)
  })

  it("a qcow2 root (an overlay of the golden) is attached as qcow2; the balloon reports free pages", () => {
    const argv = buildQemuArgv({ ...input, rootDisk: "/s/root.qcow2", rootDiskFormat: "qcow2" })
    expect(valueOf(argv, "-drive")[0]).toBe(
      "file=/s/root.qcow2,format=qcow2,if=virtio,cache=writeback,discard=unmap"
    )
    expect(valueOf(argv, "-device")).toContain("virtio-balloon-pci,free-page-reporting=on")
    expect(valueOf(argv, "-device")).toContain("virtio-rng-pci")
  })

  it("aarch64 uses the virt machine and ttyAMA0; KVM uses -cpu host", () => {
    const argv = buildQemuArgv({ ...input, arch: "aarch64", accel: "kvm" })
    expect(valueOf(argv, "-machine")).toEqual(["virt,accel=kvm"])
    expect(valueOf(argv, "-cpu")).toEqual(["host"])
    expect(valueOf(argv, "-append")[0]).toMatch(/^console=ttyAMA0 /)
  })

  it("kernel args are appended (tests), commas in paths are escaped", () => {
    const argv = buildQemuArgv({
      ...input,
      rootDisk: "/a,b/root.raw",
      kernelArgs: ["abox.ignore_shutdown=1"]
    })
    expect(valueOf(argv, "-drive")[0]).toBe(
      "file=/a,,b/root.raw,format=raw,if=virtio,cache=writeback,discard=unmap"
    )
    expect(valueOf(argv, "-append")[0]).toContain("abox.ignore_shutdown=1")
  })

  it("escaping round-trips: splitting on single commas never cuts a path", () => {
    fc.assert(
      fc.property(fc.string(), (p) => {
        const escaped = escapeOptionValue(p)
        const parts = escaped.split(/(?<!,),(?!,)/)
        expect(parts.join(",")).toBe(escaped)
        expect(escaped.replaceAll(",,", ",")).toBe(p)
      })
    )
  })

  it("QEMU's environment is minimal: nothing from the host's, so no secret can ride along", () => {
    process.env.ABOX_TEST_SECRET = "sk-should-not-leak"
    const env = minimalEnv()
    expect(Object.keys(env).sort()).toEqual(["LANG", "PATH"])
    expect(JSON.stringify(env)).not.toContain("sk-should-not-leak")
    delete process.env.ABOX_TEST_SECRET
  })
})

describe("repository disks on the command lines", () => {
  it("QEMU: the overlay writable and the baseline read-only, by serial, on PCI slots after root and config", () => {
    const argv = buildQemuArgv({
      ...input,
      repoDisks: { repo: "/s/repo.qcow2", repoFormat: "qcow2", base: "/s/a,b/repo-base.raw" }
    })
    expect(valueOf(argv, "-drive")).toEqual([
      "file=/s/root.raw,format=raw,if=virtio,cache=writeback,discard=unmap",
      "file=/s/config.raw,format=raw,if=virtio,readonly=on",
      "file=/s/repo.qcow2,format=qcow2,if=none,id=repo,cache=writeback,discard=unmap",
      "file=/s/a,,b/repo-base.raw,format=raw,if=none,id=base,readonly=on"
    ])
    expect(valueOf(argv, "-device")).toContain("virtio-blk-pci,drive=repo,serial=abox-repo,addr=0x10")
    expect(valueOf(argv, "-device")).toContain("virtio-blk-pci,drive=base,serial=abox-base,addr=0x11")
    expect(valueOf(buildQemuArgv(input), "-drive")).toHaveLength(2)
  })

  it("vfkit: raw disks with their device ids; a qcow2 overlay is refused", async () => {
    const { buildVfkitArgv } = await import("../src/vmm/vfkit.js")
    const Either = await import("effect/Either")
    const base = {
      kernel: "/img/Image",
      initrd: "/img/initrd.gz",
      rootDisk: "/s/root.raw",
      configDisk: "/s/config.raw",
      rpcSocket: "/s/rpc.sock",
      restSocket: "/s/vfkit.sock",
      consoleLog: "/s/console.log",
      cpus: 2,
      memoryMiB: 1024
    }
    const argv = Either.getOrThrow(
      buildVfkitArgv({
        ...base,
        repoDisks: { repo: "/s/repo.raw", repoFormat: "raw", base: "/s/repo-base.raw" }
      })
    )
    expect(valueOf(argv, "--device")).toContain("virtio-blk,path=/s/repo.raw,deviceId=abox-repo")
    expect(valueOf(argv, "--device")).toContain(
      "virtio-blk,path=/s/repo-base.raw,readonly,deviceId=abox-base"
    )
    expect(
      Either.isLeft(
        buildVfkitArgv({
          ...base,
          repoDisks: { repo: "/s/repo.qcow2", repoFormat: "qcow2", base: "/s/b.raw" }
        })
      )
    ).toBe(true)
  })
})
