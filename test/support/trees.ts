/**
 * Trees for the repository tests: a source with every kind of entry, the agent-like turn that
 * changes it (edit, add, delete, rename, chmod, binary, symlink), and an exact manifest of a
 * directory to compare two trees byte for byte (types, permission bits, contents, link targets).
 */
import { execFileSync } from "node:child_process"
import { createHash } from "node:crypto"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"

export const sourceRepo = (): string => {
  const source = fs.mkdtempSync(path.join(os.tmpdir(), "abox-repo-src-"))
  fs.writeFileSync(path.join(source, "README.md"), "# project\n\nline two\n")
  fs.mkdirSync(path.join(source, "src"))
  fs.writeFileSync(path.join(source, "src", "main.c"), "int main(void) { return 0; }\n")
  fs.writeFileSync(path.join(source, "src", "old-name.txt"), "renamed content\n".repeat(20))
  fs.writeFileSync(path.join(source, "doomed.txt"), "to be deleted\n")
  fs.writeFileSync(path.join(source, "run.sh"), "#!/bin/sh\necho ran\n", { mode: 0o644 })
  fs.writeFileSync(path.join(source, "blob.bin"), Buffer.from([0, 1, 2, 3, 255, 254, 0, 10]))
  fs.symlinkSync("README.md", path.join(source, "readme-link"))
  fs.symlinkSync("/etc/hostname", path.join(source, "outside-link"))
  fs.writeFileSync(path.join(source, "back\\slash.txt"), "a name with a backslash\n")
  fs.mkdirSync(path.join(source, "empty-dir"))
  // the user's own .git: copied in as it is, never part of a diff
  fs.mkdirSync(path.join(source, ".git"))
  fs.writeFileSync(path.join(source, ".git", "HEAD"), "ref: refs/heads/main\n")
  return source
}

/** what an agent's turn does, in shell (busybox sh, no git needed in the guest) */
export const AGENT_TURN = [
  "set -e",
  "printf 'line one\\nline two changed\\n' > README.md",
  "printf 'brand new\\n' > src/new.txt",
  "rm doomed.txt",
  "mv src/old-name.txt src/new-name.txt",
  "chmod 755 run.sh",
  "printf '\\000\\001\\002\\377binary\\000' > image.bin",
  "printf '\\377\\376changed\\000' > blob.bin",
  "ln -s src/main.c main-link",
  "rm readme-link && ln -s src/new.txt readme-link",
  "echo 'ref: refs/heads/agent' > .git/HEAD",
  "echo done"
].join("\n")

export interface ManifestEntry {
  readonly type: "file" | "dir" | "link"
  readonly mode?: number
  readonly sha256?: string
  readonly target?: string
}

/** every entry under `dir` (less `skip` at the top), exactly */
export const manifest = (dir: string, skip: ReadonlyArray<string> = []): Record<string, ManifestEntry> => {
  const out: Record<string, ManifestEntry> = {}
  const visit = (rel: string) => {
    for (const name of fs.readdirSync(path.join(dir, rel)).sort()) {
      if (rel === "" && skip.includes(name)) continue
      const relPath = rel === "" ? name : `${rel}/${name}`
      const full = path.join(dir, relPath)
      const stat = fs.lstatSync(full)
      if (stat.isSymbolicLink()) out[relPath] = { type: "link", target: fs.readlinkSync(full) }
      else if (stat.isDirectory()) {
        out[relPath] = { type: "dir" }
        visit(relPath)
      } else {
        out[relPath] = {
          type: "file",
          // git records the executable bit only
          mode: stat.mode & 0o100 ? 0o755 : 0o644,
          sha256: createHash("sha256").update(fs.readFileSync(full)).digest("hex")
        }
      }
    }
  }
  visit("")
  return out
}

/** empty directories have no place in a patch: the manifest without them */
export const withoutEmptyDirs = (m: Record<string, ManifestEntry>): Record<string, ManifestEntry> =>
  Object.fromEntries(
    Object.entries(m).filter(
      ([p, e]) =>
        e.type !== "dir" ||
        Object.keys(m).some((other) => other.startsWith(`${p}/`) && m[other]!.type !== "dir")
    )
  )

/** a clean copy of `source` (cp -a), with the patch applied by `git apply` */
export const applyToCopy = (source: string, patch: string): string => {
  const copy = fs.mkdtempSync(path.join(os.tmpdir(), "abox-repo-copy-"))
  execFileSync("cp", ["-a", `${source}/.`, copy])
  execFileSync("git", ["apply", "--whitespace=nowarn"], {
    cwd: copy,
    input: patch,
    env: { PATH: process.env.PATH ?? "", HOME: copy, GIT_CEILING_DIRECTORIES: path.dirname(copy) }
  })
  return copy
}
