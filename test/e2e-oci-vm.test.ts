/**
 * An OCI image built in the test (test/support/oci.ts: busybox and files of every kind in a
 * first layer; a second that whites out a file and a directory and makes a directory opaque),
 * in both forms (oci-archive, docker save), imported with the built CLI, booted in a real VM
 * (QEMU, the Debian cloud kernel, the real guest agent from /opt/abox) and given a turn with
 * `abox run --image`: the turn sees the top layer's files, not the whited-out ones, the image's
 * Env, the owners, modes and links the layers said, and the repository in /work/repo.
 */
import { afterAll, beforeAll, describe, expect, it } from "@effect/vitest"
import { execFile } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { ensureTestImage, repoRoot, testHome, vmSkipReason } from "./e2e-vm-image.js"
import { archiveOf, dockerLayout, ociLayout, sampleImage } from "./support/oci.js"

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`OCI import VM tests skipped: ${skip}`)

const cli = path.join(repoRoot, "dist", "abox.js")
let home = ""
let source = ""

beforeAll(async () => {
  if (skip !== undefined) return
  await ensureTestImage()
  home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-oci-"))
  fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
  source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-e2e-oci-src-"))
  fs.writeFileSync(path.join(source, "README.md"), "the repository\n")
}, 900_000)
afterAll(() => {
  // what a failed test left registered (a passing one removes its image itself)
  if (home !== "")
    for (const name of ["oci-e2e-oci-archive", "oci-e2e-docker-archive"])
      fs.rmSync(path.join(testHome, "images", name), { recursive: true, force: true })
  if (home !== "") fs.rmSync(home, { recursive: true, force: true })
  if (source !== "") fs.rmSync(source, { recursive: true, force: true })
})

/** the CLI as a child, awaited (not spawnSync: the test worker keeps answering its runner meanwhile) */
const runCli = (args: ReadonlyArray<string>) =>
  new Promise<{ code: number | null; stdout: string; stderr: string }>((resolve) => {
    execFile(
      process.execPath,
      [cli, ...args],
      {
        env: { PATH: process.env.PATH ?? "", HOME: os.homedir(), ABOX_HOME: home },
        encoding: "utf8",
        timeout: 300_000
      },
      (error, stdout, stderr) =>
        resolve({
          code: error === null ? 0 : typeof error.code === "number" ? error.code : null,
          stdout,
          stderr
        })
    )
  })

const TURN = [
  "cat /top.txt",
  "test -e /gone.txt && echo gone-is-there",
  "test -e /dir-gone && echo dir-gone-is-there",
  "ls /opq",
  'echo "greeting=$OCI_GREETING path=$PATH"',
  "stat -c '%u:%g %a' /owned.txt /srv",
  "stat -c '%a' /suid",
  "readlink /link",
  "stat -c '%i' /hard /hardsrc | uniq | wc -l",
  "stat -c '%F' /fifo",
  // what the file tools' child runs as the repository user: abox's node through its own loader
  "/opt/abox/bin/node -e 'console.log(process.getuid())'",
  "id -u",
  "pwd",
  "cat README.md"
].join("; ")

const EXPECTED = [
  "from the top layer",
  "upper.txt",
  "greeting=hello from the image path=/bin",
  "1234:2345 640",
  "1234:2345 750",
  "4755",
  "owned.txt",
  "1",
  "fifo",
  "1000",
  "1000",
  "/work/repo",
  "the repository"
].join("\n")

describe.skipIf(skip !== undefined)("an imported OCI image in a VM", () => {
  for (const form of ["oci-archive", "docker-archive"] as const) {
    it(`${form}: imports, boots and runs a turn`, async () => {
      const image = sampleImage(fs.readFileSync("/usr/bin/busybox"), `oci-e2e:${form}`)
      const archive = path.join(source, "..", `${path.basename(source)}-${form}.tar`)
      fs.writeFileSync(archive, archiveOf(form === "oci-archive" ? ociLayout(image) : dockerLayout(image)))
      try {
        const name = `oci-e2e-${form}`
        const imported = await runCli(["image", "import", archive, "--name", name, "--json"])
        expect(imported.code, imported.stderr).toBe(0)
        const meta = JSON.parse(imported.stdout) as {
          image: { digest: string; source: { reference: string } }
        }
        expect(meta.image.source.reference).toBe(`docker.io/library/oci-e2e:${form}`)
        const turn = await runCli(["run", "--rm", "--image", name, source, "--", TURN])
        expect(turn.stdout.trim(), turn.stderr).toBe(EXPECTED)
        expect(turn.code, turn.stderr).toBe(0)
        const removed = await runCli(["image", "rm", "--force", `${name}@${meta.image.digest}`])
        expect(removed.code, removed.stderr).toBe(0)
      } finally {
        fs.rmSync(archive, { force: true })
      }
    }, 600_000)
  }
})
