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
   * the layout of an image's warm snapshot (docs/on-disk.md "Warm snapshots"): no config or
   * repository disk (the guest waits for its session, `abox.session=wait`); with `incoming`, the
   * VM's state is restored from that file (it runs as soon as it is loaded). The argv is the
   * same for the snapshot's boot and every restore but for the files it names.
   */
  readonly warm?: { readonly incoming?: string | undefined } | undefined
}

/** a path as one word of `sh -c` (QEMU runs an exec: migration URI through the shell) */
export const shellQuote = (value: string): string => `'${value.replaceAll("'", `'\\''`)}'`

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
  const machine = x86 ? `q35,accel=${input.accel}` : `virt,accel=${input.accel}`
  const cpu = input.accel === "tcg" ? "max" : "host"
  const console = x86 ? "ttyS0" : "ttyAMA0"
  const warm = input.warm
  const append = [
    `console=${console}`,
    "quiet",
    "panic=-1",
    ...(warm === undefined ? [] : ["abox.session=wait"]),
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
    ...(warm === undefined
      ? ["-drive", `file=${escapeOptionValue(input.configDisk)},format=raw,if=virtio,readonly=on`]
      : []),
    // the repository (writable: an overlay of the baseline) and the baseline (read-only), found
    // by the guest by their serials; pinned to high PCI slots so that they enumerate after the
    // root and config disks (auto-assigned low slots), which stay vda and vdb for the initrd
    // of every image
    ...(input.repoDisks === undefined || warm !== undefined
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
    ...(warm?.incoming === undefined ? [] : ["-incoming", `exec:cat ${shellQuote(warm.incoming)}`])
  ]
}

/** the environment QEMU starts with: nothing inherited (no secret can ride along) */
export const minimalEnv = (): Record<string, string> => ({
  PATH: "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
  LANG: "C"
})
