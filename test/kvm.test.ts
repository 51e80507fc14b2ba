/**
 * The KVM probe (src/vmm/kvm.ts) through @effect/platform Command, against stand-in QEMU
 * binaries: a clean quit is "usable", an error line or a failed exit is not, a missing binary is
 * not, and a probe VM that never quits is killed at the 10 s bound (TestClock) and is not.
 */
import * as NodeContext from "@effect/platform-node/NodeContext"
import { expect, layer } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as TestClock from "effect/TestClock"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { kvmIsPvmOnly, probeKvm } from "../src/vmm/kvm.js"
import { alive } from "./support/processes.js"

const fakeQemu = (script: string) => {
  const file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), "abox-kvm-")), "qemu-system-x86_64")
  fs.writeFileSync(file, `#!/bin/sh\n${script}\n`, { mode: 0o755 })
  return file
}

layer(NodeContext.layer)("the KVM probe", (it) => {
  it.effect(
    "a VM that reads its QMP commands and quits cleanly: usable; an error or a failed exit: not",
    () =>
      Effect.gen(function* () {
        // the probe's QMP commands arrive on stdin, and its argv asks for KVM
        const ok = fakeQemu('cat > "$0.stdin"; echo "$@" > "$0.argv"; exit 0')
        expect(yield* probeKvm(ok, "x86_64")).toBe(true)
        expect(fs.readFileSync(`${ok}.stdin`, "utf8")).toContain('{"execute":"quit"}')
        expect(fs.readFileSync(`${ok}.argv`, "utf8")).toContain("q35,accel=kvm")
        expect(
          yield* probeKvm(fakeQemu("cat >/dev/null; echo 'qemu: error: KVM refused' >&2"), "x86_64")
        ).toBe(false)
        expect(yield* probeKvm(fakeQemu("cat >/dev/null; exit 1"), "x86_64")).toBe(false)
        expect(yield* probeKvm("/nonexistent/qemu-system-x86_64", "x86_64")).toBe(false)
      })
  )

  it.effect("a probe VM that never quits: killed at 10 s, not usable", () =>
    Effect.gen(function* () {
      const hung = fakeQemu('echo $$ > "$0.pid"; exec sleep 1000')
      const probe = yield* Effect.fork(probeKvm(hung, "x86_64"))
      // the stand-in is running (real time: its start is a real process)
      yield* Effect.promise(async () => {
        for (let i = 0; i < 200 && !fs.existsSync(`${hung}.pid`); i++)
          await new Promise((r) => setTimeout(r, 25))
      })
      const pid = Number(fs.readFileSync(`${hung}.pid`, "utf8"))
      expect(alive(pid)).toBe(true)
      yield* TestClock.adjust("10 seconds")
      expect(yield* Fiber.join(probe)).toBe(false)
      expect(alive(pid)).toBe(false)
    })
  )
})

layer(NodeContext.layer)("a PVM-only KVM", (it) => {
  it("kvm_pvm without kvm_intel or kvm_amd is PVM-only (stock kernels fail on it); with either, or neither, it is not", () => {
    const modules = (...names: Array<string>) => {
      const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-modules-"))
      for (const name of names) fs.mkdirSync(path.join(dir, name))
      return dir
    }
    expect(kvmIsPvmOnly(modules("kvm", "kvm_pvm"))).toBe(true)
    expect(kvmIsPvmOnly(modules("kvm", "kvm_pvm", "kvm_intel"))).toBe(false)
    expect(kvmIsPvmOnly(modules("kvm", "kvm_pvm", "kvm_amd"))).toBe(false)
    expect(kvmIsPvmOnly(modules("kvm", "kvm_intel"))).toBe(false)
    expect(kvmIsPvmOnly(modules())).toBe(false)
  })
})
