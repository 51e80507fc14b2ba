import * as Effect from "effect/Effect"
// Raw node:child_process / node:fs: /dev/kvm is probed by opening it read-write and by starting
// a paused VM on it.
import { execFile } from "node:child_process"
import * as fs from "node:fs"
import type { GuestArch } from "../domain/session.js"
import { hostArch } from "../lib/arch.js"
import { minimalEnv, qemuBinary } from "./argv.js"

/** whether /dev/kvm opens read-write here */
export const kvmOpens = (): boolean => {
  try {
    fs.closeSync(fs.openSync("/dev/kvm", fs.constants.O_RDWR))
    return true
  } catch {
    return false
  }
}

/**
 * /dev/kvm opening is not enough (nested hosts may refuse the CPU model at reset): start a
 * paused VM with `-cpu host` and quit it over QMP on stdin; success = a clean exit.
 */
export const probeKvm = (binary: string, arch: GuestArch) =>
  Effect.async<boolean>((resume) => {
    const machine = arch === "x86_64" ? "q35" : "virt"
    const child = execFile(
      binary,
      [
        "-nodefaults",
        "-no-user-config",
        "-machine",
        `${machine},accel=kvm`,
        "-cpu",
        "host",
        "-display",
        "none",
        "-S",
        "-qmp",
        "stdio"
      ],
      { env: minimalEnv(), timeout: 10_000 },
      (error, _stdout, stderr) => resume(Effect.succeed(error === null && !/error/i.test(stderr)))
    )
    child.stdin?.end('{"execute":"qmp_capabilities"}\n{"execute":"query-status"}\n{"execute":"quit"}\n')
  })

/** what `auto` chooses on this host: KVM when /dev/kvm opens and a probe VM starts on it (abox doctor) */
export const kvmUsable = (arch: GuestArch = hostArch()): Effect.Effect<boolean> =>
  kvmOpens() ? probeKvm(qemuBinary(arch), arch) : Effect.succeed(false)
