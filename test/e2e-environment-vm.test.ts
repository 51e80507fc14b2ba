/**
 * Project environments in a real VM (QEMU, real kernel, real guest agent, the busybox test image
 * as base; docs/environments.md): a repository's setup script runs as root once and installs a
 * root-owned tool and a system user, with the repository read-only; its install step runs as the
 * repository user after each Open; its env reaches turns; the image it leaves is an overlay over
 * the base's root.raw; a second Open reuses it (no setup), an edited setup.sh rebuilds; the base
 * cannot be removed under it; a failing setup is a typed error with its output's tail and leaves
 * nothing; a requested host is not granted without consent; a devcontainer.json with comments
 * is read.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import { execFileSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { envList, envRemove, openWithEnvironment } from "../src/programs/environment.js"
import { imageRemove } from "../src/programs/image.js"
import { remove } from "../src/programs/remove.js"
import type { TurnEvent } from "../src/services/GuestRpc.js"
import { SessionStore } from "../src/services/SessionStore.js"
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Layer from "effect/Layer"
import { HttpsBrokerLive } from "../src/broker/HttpsBrokerLive.js"
import { GuestRpcLive } from "../src/layers/guestRpc/index.js"
import { ImagesLive } from "../src/layers/ImagesLive.js"
import { QemuVmmLive } from "../src/layers/QemuVmm.js"
import { RuntimeLockLive } from "../src/layers/RuntimeLockLive.js"
import { SessionStoreLive } from "../src/layers/SessionStoreLive.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"
import { ensureTestImage, runTurn, testHome, vmSkipReason } from "./e2e-vm-image.js"

const layerFor = (home: string) =>
  Layer.mergeAll(
    SessionStoreLive,
    RuntimeLockLive,
    GuestRpcLive,
    HttpsBrokerLive,
    QemuVmmLive({ note: () => undefined }),
    ImagesLive
  ).pipe(
    Layer.provideMerge(aboxPathsAt(home)),
    Layer.provideMerge(NodeCommandExecutor.layer),
    Layer.provideMerge(NodeFileSystem.layer)
  )

const skip = vmSkipReason()
if (skip !== undefined) console.warn(`e2e-environment-vm: skipped: ${skip}`)

const SETUP = `set -e
echo "setup as uid $(id -u)"
printf '#!/bin/sh\\necho tool-ok\\n' > /usr/local/bin/mytool
chmod 755 /usr/local/bin/mytool
# a system user (busybox has no adduser applet here): as useradd --system would write it
echo 'svcuser:x:999:999:service:/nonexistent:/bin/false' >> /etc/passwd
echo 'svcuser:x:999:' >> /etc/group
if touch /work/repo/written 2>/dev/null; then echo repo-writable; else echo repo-read-only; fi
echo "setup sees GREETING=$GREETING"
`

const writeRepo = (dir: string, files: Record<string, string>) => {
  for (const [file, text] of Object.entries(files)) {
    fs.mkdirSync(path.dirname(path.join(dir, file)), { recursive: true })
    fs.writeFileSync(path.join(dir, file), text)
  }
}

const collector = () => {
  let text = ""
  return {
    onOutput: (event: TurnEvent) =>
      Effect.sync(() => {
        if (event._tag === "Event" && (event.event.kind === "stdout" || event.event.kind === "stderr"))
          text += event.event.data
      }),
    text: () => text
  }
}

describe.skipIf(skip !== undefined)("project environments in a real VM", () => {
  it.live(
    "setup as root once → install as the user → env in turns → reused → rebuilt on edit → base kept → failing setup typed → host not granted → devcontainer read",
    () => {
      const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-env-vm-"))
      const repo = fs.mkdtempSync(path.join(os.tmpdir(), "abox-env-vm-repo-"))
      const failing = fs.mkdtempSync(path.join(os.tmpdir(), "abox-env-vm-fail-"))
      const dev = fs.mkdtempSync(path.join(os.tmpdir(), "abox-env-vm-dev-"))
      writeRepo(repo, {
        "README.md": "# env\n",
        ".abox/environment.json": JSON.stringify({
          base: "abox",
          install: "id -un > /tmp/install-user; echo installing as $(id -un)",
          env: { GREETING: "hello-env" },
          allow: ["example.org"]
        }),
        ".abox/setup.sh": SETUP
      })
      writeRepo(failing, {
        ".abox/environment.json": JSON.stringify({ base: "abox" }),
        ".abox/setup.sh": "echo about to fail\nexit 3\n"
      })
      writeRepo(dev, {
        ".devcontainer/devcontainer.json": `{
  // comments, as devcontainer.json has them
  "image": "abox", /* the registered test image */
  "onCreateCommand": "echo made-by-oncreate > /etc/devcontainer-made",
  "postCreateCommand": ["sh", "-c", "echo post > /tmp/post"],
  "containerEnv": { "FROM_DEV": "dev-env", },
  "customizations": { "vscode": {} },
}`
      })
      return Effect.gen(function* () {
        yield* Effect.promise(() => ensureTestImage())
        fs.symlinkSync(path.join(testHome, "images"), path.join(home, "images"))
        const store = yield* SessionStore
        const sessionsBefore = (yield* store.list()).length
        const notices: Array<string> = []
        const onNotice = (line: string) => Effect.sync(() => void notices.push(line))

        // 1. the first Open builds the environment, then runs install as the user
        const setup1 = collector()
        const install1 = collector()
        const first = yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* openWithEnvironment({
              source: repo,
              memoryMiB: 512,
              onSetupOutput: setup1.onOutput,
              onInstallOutput: install1.onOutput,
              onNotice
            })
            const facts = yield* runTurn(
              session.connection,
              "mytool; stat -c '%U %a' /usr/local/bin/mytool; grep -c '^svcuser:' /etc/passwd; echo \"G=$GREETING\"; cat /tmp/install-user; id -un"
            )
            return { facts, meta: session.meta, id: session.id }
          })
        )
        expect(setup1.text()).toContain("setup as uid 0")
        expect(setup1.text()).toContain("repo-read-only")
        expect(setup1.text()).toContain("setup sees GREETING=hello-env")
        expect(install1.text()).toContain("installing as agent")
        expect(first.facts.split("\n")).toEqual(["tool-ok", "root 755", "1", "G=hello-env", "agent", "agent", ""])
        // the requested host was not granted: not in the session's policy, and the user was told
        expect(first.meta.policy?.allow.some((rule) => rule.host === "example.org")).toBe(false)
        expect(notices.some((line) => line.includes("example.org: not granted"))).toBe(true)

        const built = yield* envList()
        const mine = built.filter((image) => image.meta.environment?.source === repo)
        expect(mine.length).toBe(1)
        const envImage = mine[0]!
        expect(first.meta.image?.digest).toBe(envImage.meta.digest)
        // an overlay over the base's root.raw, not a copy
        const info = JSON.parse(
          execFileSync("qemu-img", ["info", "--output=json", path.join(envImage.dir, "root.qcow2")], {
            encoding: "utf8"
          })
        ) as { format: string; "backing-filename"?: string }
        expect(info.format).toBe("qcow2")
        expect(info["backing-filename"]).toContain(path.join(envImage.meta.environment!.base.name, envImage.meta.environment!.base.digest, "root.raw"))
        const baseRoot = fs.statSync(info["backing-filename"]!)
        expect(envImage.meta.environment!.overlayBytes).toBeLessThan(baseRoot.blocks * 512)
        // the session's root is an overlay over the environment's
        const sessionRoot = JSON.parse(
          execFileSync("qemu-img", ["info", "--output=json", path.join(home, "sessions", first.id, "root.qcow2")], {
            encoding: "utf8"
          })
        ) as { "backing-filename"?: string }
        expect(sessionRoot["backing-filename"]).toBe(path.join(envImage.dir, "root.qcow2"))

        // 2. a second Open reuses it: no setup runs; --allow-env-hosts grants the requested host
        const setup2 = collector()
        const second = yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* openWithEnvironment({
              source: repo,
              memoryMiB: 512,
              allowEnvHosts: true,
              onSetupOutput: setup2.onOutput
            })
            return { meta: session.meta, facts: yield* runTurn(session.connection, "mytool; echo $GREETING") }
          })
        )
        expect(setup2.text()).toBe("")
        expect(second.facts).toBe("tool-ok\nhello-env\n")
        expect(second.meta.image?.digest).toBe(envImage.meta.digest)
        expect(second.meta.policy?.allow.some((rule) => rule.host === "example.org")).toBe(true)

        // 3. the base cannot go while an environment image is layered over it
        const refused = yield* Effect.flip(
          imageRemove(`${envImage.meta.environment!.base.name}@${envImage.meta.environment!.base.digest}`, true)
        )
        expect(refused._tag).toBe("ImageInUse")
        expect(refused.message).toContain("environment image")
        expect(fs.existsSync(info["backing-filename"]!)).toBe(true)

        // 4. editing setup.sh rebuilds
        fs.appendFileSync(path.join(repo, ".abox", "setup.sh"), "echo second-version\n")
        const setup3 = collector()
        yield* Effect.scoped(openWithEnvironment({ source: repo, memoryMiB: 512, onSetupOutput: setup3.onOutput }))
        expect(setup3.text()).toContain("second-version")
        expect((yield* envList()).filter((image) => image.meta.environment?.source === repo).length).toBe(2)

        // 5. a failing setup: typed, with its output's tail and status; no image, no session left
        const failed = yield* Effect.scoped(Effect.flip(openWithEnvironment({ source: failing, memoryMiB: 512 })))
        expect(failed._tag).toBe("EnvironmentSetupFailed")
        if (failed._tag === "EnvironmentSetupFailed") {
          expect(failed.exitCode).toBe(3)
          expect(failed.logTail).toContain("about to fail")
        }
        expect((yield* envList()).some((image) => image.meta.environment?.source === failing)).toBe(false)

        // 6. devcontainer.json with comments: image, onCreateCommand, postCreateCommand, containerEnv
        const devNotices: Array<string> = []
        const devFacts = yield* Effect.scoped(
          Effect.gen(function* () {
            const session = yield* openWithEnvironment({
              source: dev,
              memoryMiB: 512,
              onNotice: (line) => Effect.sync(() => void devNotices.push(line))
            })
            return yield* runTurn(session.connection, "cat /etc/devcontainer-made /tmp/post; echo $FROM_DEV")
          })
        )
        expect(devFacts).toBe("made-by-oncreate\npost\ndev-env\n")
        expect(devNotices.some((line) => line.includes("ignored") && line.includes("customizations"))).toBe(true)

        // the sessions made here (the setup VMs' are gone already), then the environment images
        const sessions = yield* store.list()
        expect(sessions.length).toBe(sessionsBefore + 4)
        yield* remove(sessions.map((row) => row.id))
        yield* envRemove(repo)
        yield* envRemove(dev)
        expect((yield* envList()).filter((image) => [repo, dev].includes(image.meta.environment!.source))).toEqual([])
      }).pipe(
        Effect.provide(layerFor(home)),
        Effect.ensuring(
          Effect.sync(() => {
            for (const dir of [home, repo, failing, dev]) fs.rmSync(dir, { recursive: true, force: true })
          })
        )
      )
    },
    900_000
  )
})
