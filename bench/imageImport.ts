/**
 * `abox image import` (docs/images.md): the import of the test OCI image (test/support/oci.ts:
 * busybox and files of every kind in one layer, a gzipped layer of whiteouts, an opaque
 * directory and new files; about 2 MB) through the built CLI, into the test home's registry
 * (its base: the small test image), against a floor: `mkfs.ext4 -d` of the same finished tree
 * (read back out of the imported root.raw), the one step no importer avoids. The note gives the
 * imported root.raw's allocated bytes (sparse) and the image's directory in all.
 */
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { ensureTestImage, testHome } from "../test/e2e-vm-image.js"
import { archiveOf, ociLayout, sampleImage } from "../test/support/oci.js"
import { type BenchContext, type Figure, cli, median, round, timeOnce } from "./lib.js"

const allocated = (file: string) => fs.statSync(file).blocks * 512
const MiB = 1024 * 1024

export const imageImport = async (ctx: BenchContext): Promise<Figure> => {
  await ensureTestImage()
  const home = fs.mkdtempSync(path.join(ctx.tmp, "import-home-"))
  fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
  const archive = path.join(ctx.tmp, "bench-oci.tar")
  fs.writeFileSync(
    archive,
    archiveOf(ociLayout(sampleImage(fs.readFileSync("/usr/bin/busybox"), "bench-oci:1")))
  )
  const env = { ABOX_HOME: home, HOME: os.homedir() }
  const runs = Math.max(1, Math.min(ctx.runs, 3))
  const imports: Array<number> = []
  const floors: Array<number> = []
  let rootBytes = 0
  let imageBytes = 0
  for (let i = 0; i < runs; i++) {
    imports.push(timeOnce([process.execPath, cli, "image", "import", archive, "--name", "bench-oci"], env))
    const listed = spawnSync(process.execPath, [cli, "image", "list", "--json"], {
      env: { ...process.env, ...env },
      encoding: "utf8"
    })
    const image = (
      JSON.parse(listed.stdout) as { images: Array<{ name: string; digest: string; dir: string }> }
    ).images.find((entry) => entry.name === "bench-oci")!
    const root = path.join(image.dir, "root.raw")
    rootBytes = allocated(root)
    imageBytes = fs
      .readdirSync(image.dir)
      .reduce((sum, file) => sum + allocated(path.join(image.dir, file)), 0)
    // the floor: mkfs.ext4 -d of the finished tree, read back out of the imported disk
    const tree = fs.mkdtempSync(path.join(ctx.tmp, "tree-"))
    spawnSync("debugfs", ["-R", `rdump / ${tree}`, root], { stdio: "ignore" })
    const disk = path.join(ctx.tmp, "floor.raw")
    fs.writeFileSync(disk, "")
    fs.truncateSync(disk, fs.statSync(root).size)
    floors.push(timeOnce(["mkfs.ext4", "-q", "-F", "-d", tree, disk]))
    fs.rmSync(tree, { recursive: true, force: true })
    fs.rmSync(disk, { force: true })
    timeOnce([process.execPath, cli, "image", "rm", "--force", `bench-oci@${image.digest}`], env)
  }
  const a = median(imports)
  const b = median(floors)
  return {
    ratio: round(a / b),
    medianMs: round(a, 1),
    floorMs: round(b, 1),
    runs,
    note: `imported root.raw allocates ${round(rootBytes / MiB, 1)} MiB (the image directory ${round(imageBytes / MiB, 1)} MiB with its kernel and initrd)`
  }
}
