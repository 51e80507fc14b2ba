import type { GuestArch } from "../domain/session.js"
import type { DiskFormat, RepoDisks } from "../domain/vm.js"

export type Accel = "kvm" | "tcg" | "hvf"

export interface QemuArgvInput {
  readonly arch: GuestArch
  readonly accel: Accel
  readonly kernel: string
  readonly initrd: string
  readonly rootDisk: string
  /** default raw; qcow2 for an overlay of the golden image */
  readonly rootDiskFormat?: DiskFormat | undefined
  readonly configDisk: string
  readonly rpcSocket: string
  readonly qmpSocket: string
  readonly cpus: number
  readonly memoryMiB: number
  readonly kernelArgs?: ReadonlyArray<string> | undefined
  readonly repoDisks?: RepoDisks | undefined
  /**
   * the machine type; default the newest of its family (`q35`, `virt`). A restore pins the
   * versioned type its state was saved under (src/vmm/migration.ts)
   */
  readonly machine?: string | undefined
  /** start paused, waiting for `migrate-incoming` over QMP (a restore) */
  readonly incoming?: boolean | undefined
  /**
   * the layout of an image's warm snapshot (docs/on-disk.md "Warm snapshots"): no config disk
   * (the guest waits for its session, `abox.session=wait`) and no repository disk at start, but
   * two free hot-plug slots (WARM_HOTPLUG_PORTS) the repository disks are plugged into after the
   * restore. The same argv for the snapshot's boot and every restore but for the files it names.
   */
  readonly warm?: boolean | undefined
  /**
   * the warm layout with the repository disks already in their slots (the resume of a suspended
   * session that was opened warm: its state has the devices a warm Open hot-plugged)
   */
  readonly plugged?: boolean | undefined
}

/** the warm layout's hot-plug slots (pcie-root-port ids): the repository disk, its baseline */
export const WARM_HOTPLUG_PORTS = { repo: "abox-hp-repo", base: "abox-hp-base" } as const

export const qemuBinary = (arch: GuestArch): string =>
  arch === "x86_64" ? "qemu-system-x86_64" : "qemu-system-aarch64"

/** QEMU's option values are comma-separated: a comma inside a path is written twice */
export const escapeOptionValue = (value: string): string => value.replaceAll(",", ",,")

/**
 * The QEMU command line of a session VM: direct kernel boot, no defaults and no network
 * device at all (`-nodefaults` creates none; nothing adds one), root rw and config read-only
 * on virtio, the RPC channel as the virtio-serial port `abox.rpc` connected to the host's
 * rpc.sock, the serial console on stdout (the helper bounds it into console.log), and a QMP
 * socket for quit and status. Nothing secret is ever on it.
 */
export const buildQemuArgv = (input: QemuArgvInput): Array<string> => {
  const x86 = input.arch === "x86_64"
  const machine = `${input.machine ?? (x86 ? "q35" : "virt")},accel=${input.accel}`
  const cpu = input.accel === "tcg" ? "max" : "host"
  const console = x86 ? "ttyS0" : "ttyAMA0"
  const warm = input.warm === true
  const append = [
    `console=${console}`,
    "quiet",
    "panic=-1",
    ...(warm ? ["abox.session=wait"] : []),
    ...(input.kernelArgs ?? [])
  ].join(" ")
  return [
    "-nodefaults",
    "-no-user-config",
    "-nographic",
    "-no-reboot",
    "-machine",
    machine,
    "-cpu",
    cpu,
    "-smp",
    String(input.cpus),
    "-m",
    String(input.memoryMiB),
    "-kernel",
    input.kernel,
    "-initrd",
    input.initrd,
    "-append",
    append,
    "-drive",
    // discard=unmap: the guest's deletes (ext4 mounted with discard) free the host's blocks
    `file=${escapeOptionValue(input.rootDisk)},format=${input.rootDiskFormat ?? "raw"},if=virtio,cache=writeback,discard=unmap`,
    ...(warm
      ? []
      : ["-drive", `file=${escapeOptionValue(input.configDisk)},format=raw,if=virtio,readonly=on`]),
    // the repository (writable: an overlay of the baseline) and the baseline (read-only), found
    // by the guest by their serials; pinned to high PCI slots so that they enumerate after the
    // root and config disks (auto-assigned low slots), which stay vda and vdb for the initrd
    // of every image
    // the warm layout: the same slots as root ports, empty until the restore plugs the disks in
    ...(warm
      ? [
          "-device",
          `pcie-root-port,id=${WARM_HOTPLUG_PORTS.repo},chassis=1,bus=pcie.0,addr=0x10`,
          "-device",
          `pcie-root-port,id=${WARM_HOTPLUG_PORTS.base},chassis=2,bus=pcie.0,addr=0x11`
        ]
      : []),
    ...(warm && input.plugged === true && input.repoDisks !== undefined
      ? [
          "-drive",
          `file=${escapeOptionValue(input.repoDisks.repo)},format=${input.repoDisks.repoFormat},if=none,id=repo,cache=writeback,discard=unmap`,
          "-device",
          `virtio-blk-pci,id=abox-repo,drive=repo,serial=abox-repo,bus=${WARM_HOTPLUG_PORTS.repo}`,
          "-drive",
          `file=${escapeOptionValue(input.repoDisks.base)},format=raw,if=none,id=base,readonly=on`,
          "-device",
          `virtio-blk-pci,id=abox-base,drive=base,serial=abox-base,bus=${WARM_HOTPLUG_PORTS.base}`
        ]
      : []),
    ...(input.repoDisks === undefined || warm
      ? []
      : [
          "-drive",
          `file=${escapeOptionValue(input.repoDisks.repo)},format=${input.repoDisks.repoFormat},if=none,id=repo,cache=writeback,discard=unmap`,
          "-device",
          "virtio-blk-pci,drive=repo,serial=abox-repo,addr=0x10",
          "-drive",
          `file=${escapeOptionValue(input.repoDisks.base)},format=raw,if=none,id=base,readonly=on`,
          "-device",
          "virtio-blk-pci,drive=base,serial=abox-base,addr=0x11"
        ]),
    // the guest gives freed memory back (its virtio_balloon driver reports free pages; QEMU drops them)
    "-device",
    "virtio-balloon-pci,free-page-reporting=on",
    // entropy from the host (/dev/urandom) for the guest's kernel pool (its initrd loads virtio-rng)
    "-device",
    "virtio-rng-pci",
    "-device",
    "virtio-serial-pci",
    "-chardev",
    `socket,id=rpc,path=${escapeOptionValue(input.rpcSocket)}`,
    "-device",
    "virtserialport,chardev=rpc,name=abox.rpc",
    "-chardev",
    "stdio,id=con,signal=off",
    "-serial",
    "chardev:con",
    "-qmp",
    `unix:${escapeOptionValue(input.qmpSocket)},server=on,wait=off`,
    "-monitor",
    "none",
    "-display",
    "none",
    ...(input.incoming === true ? ["-incoming", "defer"] : [])
  ]
}

/** the environment QEMU starts with: nothing inherited (no secret can ride along) */
export const minimalEnv = (): Record<string, string> => ({
  PATH: "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
  LANG: "C"
})
