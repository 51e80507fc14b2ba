/**
 * Optional: the arm64 `small` image (images/build-small.sh --arch aarch64) boots under
 * qemu-system-aarch64 (TCG, `virt` machine) to the guest agent's hello, runs a turn and powers
 * off on shutdown. Slow (full emulation of another architecture), so it runs only when asked
 * (`ABOX_TEST_ARM64=1`, which builds the image if needed) or when an arm64 image is already
 * registered in `$ABOX_TEST_ARM64_HOME` (default `<repo>/.build/arm64-home`).
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { execFileSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { GuestRpcLive } from "../src/layers/GuestRpcLive.js"
import { QemuVmmLive } from "../src/layers/QemuVmm.js"
import { goldenOf, resolveImage } from "../src/lib/images.js"
import { buildImage } from "../src/programs/image.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import type { GoldenImage } from "../src/services/Images.js"
import { bootSession, guestBundle, repoRoot, runTurn } from "./e2e-vm-image.js"

const home = process.env.ABOX_TEST_ARM64_HOME ?? path.join(repoRoot, ".build", "arm64-home")
const asked = process.env.ABOX_TEST_ARM64 === "1"

const has = (binary: string) => {
  try {
    execFileSync("sh", ["-c", `command -v ${binary}`], { stdio: "ignore" })
    return true
  } catch {
    return false
  }
}

/** the default image of the arm64 home is an aarch64 one (its image.json says so) */
const registered = (): boolean => {
  try {
    const pointer = fs.readFileSync(path.join(home, "images", "default.json"), "utf8")
    const name = /"name":\s*"([^"]+)"/.exec(pointer)?.[1]
    const digest = /"digest":\s*"([0-9a-f]+)"/.exec(pointer)?.[1]
    if (name === undefined || digest === undefined) return false
    const meta = fs.readFileSync(path.join(home, "images", name, digest, "image.json"), "utf8")
    return /"arch":\s*"aarch64"/.test(meta)
  } catch {
    return false
  }
}

const skipReason = (): string | undefined => {
  if (process.platform !== "linux") return "the arm64 boot test runs QEMU on Linux"
  if (!has("qemu-system-aarch64"))
    return "qemu-system-aarch64 is not installed (apt-get install qemu-system-arm)"
  if (!asked && !registered())
    return `no arm64 image in ${home} (set ABOX_TEST_ARM64=1 to build one: needs dpkg --add-architecture arm64)`
  if (!fs.existsSync(guestBundle)) return "dist/ is not built (npm run build)"
  return undefined
}
const reason = skipReason()
if (reason !== undefined) console.warn(`arm64 boot test skipped: ${reason}`)

const arm64Image = Effect.gen(function* () {
  const current = yield* resolveImage(path.join(home, "images"), undefined).pipe(Effect.option)
  if (current._tag === "Some" && current.value.meta.arch === "aarch64") return goldenOf(current.value)
  const built = yield* buildImage({ arch: "aarch64", variant: "small", agent: guestBundle })
  return goldenOf(built)
}).pipe(
  Effect.provide(
    Layer.mergeAll(aboxPathsAt(home), NodeCommandExecutor.layer.pipe(Layer.provide(NodeFileSystem.layer)))
  )
)

const Live = Layer.mergeAll(
  GuestRpcLive,
  QemuVmmLive({
    arch: "aarch64",
    accel: "tcg",
    helper: [process.execPath, "--import", "tsx", path.join(repoRoot, "src", "vmm", "helper.ts")],
    note: () => undefined
  })
)

describe.skipIf(reason !== undefined)("arm64 image under qemu-system-aarch64 (TCG)", () => {
  it.live(
    "boots to hello, runs a turn on aarch64, powers off on shutdown",
    () =>
      Effect.gen(function* () {
        const image: GoldenImage = yield* arm64Image
        expect(image.arch).toBe("aarch64")
        const dir = fs.mkdtempSync(path.join(os.tmpdir(), "abox-arm64-"))
        execFileSync("cp", ["--reflink=auto", "--sparse=always", image.rootDisk, path.join(dir, "root.raw")])
        const t0 = Date.now()
        const { vm, hello, uname, helloMs } = yield* Effect.scoped(
          Effect.gen(function* () {
            const { vm, connection } = yield* bootSession(image, dir)
            const helloMs = Date.now() - t0
            const uname = yield* runTurn(connection, "uname -m")
            return { vm, hello: connection.hello, uname, helloMs }
          })
        )
        const outcome = yield* vm.outcome
        const totalMs = Date.now() - t0
        console.warn(`arm64 (TCG): hello after ${helloMs} ms, closed after ${totalMs} ms`)
        expect(hello.arch).toBe("aarch64")
        expect(uname).toBe("aarch64\n")
        expect(outcome.how).toBe("graceful")
        fs.rmSync(dir, { recursive: true, force: true })
      }).pipe(Effect.provide(Live)),
    10 * 60_000
  )
})
