/**
 * Two builds of the small recipe from the same inputs give the same image: the same digest and
 * the same kernel, initrd and root.raw bytes (images/build-small.sh: fixed times, UUID, hash seed,
 * sorted cpio, gzip -n). The builds skip the first boot (no snapshot entry): the bytes that boot
 * writes are not reproducible (docs/on-disk.md, "Reproducible images").
 */
import { it } from "@effect/vitest"
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { execFileSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { expect } from "vitest"
import { type ImageBuildPhase, buildImage } from "../src/programs/image.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { guestBundle, testHome } from "./e2e-vm-image.js"

const has = (binary: string): boolean => {
  try {
    execFileSync("sh", ["-c", `command -v ${binary}`], { stdio: "ignore" })
    return true
  } catch {
    return false
  }
}

const skipReason = ((): string | undefined => {
  if (process.platform !== "linux") return "the recipe runs on Linux"
  if (!fs.existsSync(guestBundle)) return "dist/ is not built (npm run build)"
  for (const tool of ["mkfs.ext4", "debugfs", "cpio", "dpkg-deb", "apt-get", "npm", "gzip", "cmp"]) {
    if (!has(tool)) return `${tool} is missing: the image cannot be built`
  }
  if (process.getuid?.() !== 0) return "building the image (mkfs.ext4 -d with owners) needs root"
  return undefined
})()

/** byte-for-byte (root.raw is 2 GiB, sparse: cmp rather than a read into memory) */
const sameBytes = (a: string, b: string): boolean => {
  try {
    execFileSync("cmp", ["-s", a, b], { stdio: "ignore" })
    return true
  } catch {
    return false
  }
}

it.effect.skipIf(skipReason !== undefined)(
  `two builds of the small recipe give one digest and the same bytes${skipReason === undefined ? "" : ` (skipped: ${skipReason})`}`,
  () =>
    Effect.gen(function* () {
      const scratch = fs.mkdtempSync(path.join(os.tmpdir(), "abox-repro-"))
      yield* Effect.addFinalizer(() => Effect.sync(() => fs.rmSync(scratch, { recursive: true, force: true })))
      const build = (home: string) =>
        Effect.gen(function* () {
          const phases: Array<ImageBuildPhase> = []
          const image = yield* buildImage({
            arch: "x86_64",
            variant: "small",
            agent: guestBundle,
            // no snapshot entry: no first boot (its writes are not reproducible)
            snapshotEntry: path.join(scratch, "no-snapshot-entry.cjs"),
            cacheDir: path.join(testHome, "cache"),
            onPhase: (phase) => Effect.sync(() => void phases.push(phase))
          }).pipe(Effect.provide(Layer.merge(aboxPathsAt(home), NodeCommandExecutor.layer.pipe(Layer.provide(NodeFileSystem.layer)))))
          return { image, phases }
        })
      const first = yield* build(path.join(scratch, "a"))
      const second = yield* build(path.join(scratch, "b"))
      expect(first.phases).toEqual(["download", "build", "register", "ready"])
      expect(second.image.meta.digest).toBe(first.image.meta.digest)
      for (const file of ["vmlinuz", "initrd.gz", "root.raw"]) {
        expect(sameBytes(path.join(first.image.dir, file), path.join(second.image.dir, file)), file).toBe(true)
      }
    }).pipe(Effect.scoped),
  600_000
)
