import type * as CommandExecutor from "@effect/platform/CommandExecutor"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
// Raw node:fs: /dev/kvm is probed by opening it read-write (a synchronous open and close).
import * as fs from "node:fs"
import { runCommand } from "../lib/command.js"
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
export const probeKvm = (
  binary: string,
  arch: GuestArch
): Effect.Effect<boolean, never, CommandExecutor.CommandExecutor> => {
  const machine = arch === "x86_64" ? "q35" : "virt"
  return runCommand(
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
    {
      env: minimalEnv(),
      input: '{"execute":"qmp_capabilities"}\n{"execute":"query-status"}\n{"execute":"quit"}\n'
    }
  ).pipe(
    // a probe VM that does not quit within 10 s is killed (the scope of its process)
    Effect.timeoutOption(Duration.seconds(10)),
    Effect.map((result) =>
      Option.match(result, {
        onNone: () => false,
        onSome: ({ exitCode, stderr }) => exitCode === 0 && !/error/i.test(stderr)
      })
    ),
    // QEMU missing or not executable: KVM is not usable through it
    Effect.orElseSucceed(() => false)
  )
}

/**
 * Whether this host's KVM is PVM (the `kvm_pvm` module without `kvm_intel`/`kvm_amd`): it runs only
 * guest kernels built for PVM, so a stock image's kernel stops at its first instructions with
 * "emulation failure" while a paused probe VM still starts. `modules` is sysfs's module directory.
 */
export const kvmIsPvmOnly = (modules = "/sys/module"): boolean => {
  const loaded = (name: string) => fs.existsSync(`${modules}/${name}`)
  return loaded("kvm_pvm") && !loaded("kvm_intel") && !loaded("kvm_amd")
}

/** what `auto` chooses on this host: KVM when /dev/kvm opens, is not PVM-only, and a probe VM starts on it (abox doctor) */
export const kvmUsable = (
  arch: GuestArch = hostArch()
): Effect.Effect<boolean, never, CommandExecutor.CommandExecutor> =>
  kvmOpens() && !kvmIsPvmOnly() ? probeKvm(qemuBinary(arch), arch) : Effect.succeed(false)
