import * as Chunk from "effect/Chunk"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import * as fs from "node:fs/promises"
import * as os from "node:os"
import * as path from "node:path"
import { runCommand } from "../lib/command.js"
import { writeConfigDisk } from "../lib/disk.js"
import { stripTerminalControls } from "../lib/terminalText.js"
import { findExecutable } from "../lib/executable.js"
import { ensureSocketDir, rpcSocketPath } from "../lib/socketPath.js"
import { GuestRpc } from "../services/GuestRpc.js"
import { Images } from "../services/Images.js"
import { VmmBackend } from "../services/VmmBackend.js"
import { earlyExitReport } from "../vmm/console.js"
import { uncompressedKernel } from "../vmm/vfkit.js"
import { kvmUsable } from "../vmm/kvm.js"
import { hostArch } from "../lib/arch.js"
import { qemuBinary } from "../vmm/argv.js"
import { resolveImage } from "../lib/images.js"
import { AboxPaths } from "../services/AboxPaths.js"
import { HttpsBroker } from "../services/HttpsBroker.js"
import { readCaFile } from "../broker/caFiles.js"
import { SecretScrubber } from "../services/SecretScrubber.js"

export interface Check {
  readonly name: string
  readonly status: "ok" | "warn" | "fail"
  readonly detail: string
}

/** a tool's output (stdout and stderr), found by the user's PATH; killed after 10 s; undefined if it cannot run */
const output = (command: string, args: ReadonlyArray<string>) =>
  runCommand(command, args, { env: { PATH: process.env.PATH ?? "/usr/bin:/bin", LANG: "C" } }).pipe(
    Effect.timeoutOption(Duration.seconds(10)),
    Effect.map(Option.getOrUndefined),
    // not installed or not executable: the check says so
    Effect.orElseSucceed(() => undefined)
  )

/** a version probe: the first line of a clean run's stdout */
const probe = (command: string, args: ReadonlyArray<string>) =>
  Effect.map(output(command, args), (result) =>
    result?.exitCode === 0 ? result.stdout.toString("utf8").split("\n")[0]?.trim() : undefined
  )

const GiB = 1024 ** 3

/** the policy's guestCaFiles, one check each: what the guest will trust, or why the session would not start */
const guestCaChecks = (files: ReadonlyArray<string>) =>
  Effect.forEach(files, (file) =>
    readCaFile(file).pipe(
      Effect.map((ca): Check => ({
        name: "guest-ca",
        status: "ok",
        detail: `${file}: the guest trusts ${ca.subjects.join("; ")}`
      })),
      Effect.catchAll((reason) =>
        Effect.succeed<Check>({
          name: "guest-ca",
          status: "fail",
          detail: `${file} (policy guestCaFiles): ${reason}; sessions do not start`
        })
      )
    )
  )

/** the default broker policy: absent (deny all), valid (what it allows, the guest CAs it adds), or invalid (why) */
const brokerChecks = (file: string) =>
  Effect.gen(function* () {
    const broker = yield* HttpsBroker
    const present = yield* Effect.promise(() =>
      fs.access(file).then(
        () => true,
        () => false
      )
    )
    if (!present) {
      return [
        { name: "broker", status: "ok", detail: `no ${file}: sessions reach nothing (docs/broker.md)` }
      ] satisfies ReadonlyArray<Check>
    }
    const loaded = yield* broker.loadPolicy(file).pipe(Effect.either)
    if (loaded._tag === "Left") {
      return [{ name: "broker", status: "fail", detail: loaded.left.message }] satisfies ReadonlyArray<Check>
    }
    const policy = loaded.right
    const unset = policy.credentials.flatMap((rule) =>
      "fromEnv" in rule && process.env[rule.fromEnv] === undefined ? [`$${rule.fromEnv}`] : []
    )
    const summary = `${file}: ${policy.allow.length} allow rule(s), ${policy.credentials.length} credential rule(s)`
    const check: Check =
      unset.length > 0
        ? { name: "broker", status: "warn", detail: `${summary}; not set here: ${unset.join(", ")}` }
        : { name: "broker", status: "ok", detail: summary }
    return [check, ...(yield* guestCaChecks(policy.guestCaFiles ?? []))]
  })

/**
 * `abox doctor`: what a session needs on this host, one line each — the VMM and its
 * accelerator, the default image, free space in ABOX_HOME, and the secret scrubber's state.
 */
export const doctor = Effect.fn("doctor")(function* () {
  const paths = yield* AboxPaths
  const scrubber = yield* SecretScrubber
  const checks: Array<Check> = []

  checks.push({ name: "node", status: "ok", detail: process.version })

  if (process.platform === "darwin") {
    const vfkit = yield* probe("vfkit", ["--version"])
    checks.push(
      vfkit === undefined
        ? { name: "vmm", status: "fail", detail: "vfkit not found: brew install vfkit (docs/macos.md)" }
        : { name: "vmm", status: "ok", detail: vfkit }
    )
  } else {
    const binary = qemuBinary(hostArch())
    const qemu = yield* probe(binary, ["--version"])
    checks.push(
      qemu === undefined
        ? {
            name: "vmm",
            status: "fail",
            detail: `${binary} not found: apt-get install qemu-system-x86 (scripts/setup.sh)`
          }
        : { name: "vmm", status: "ok", detail: qemu }
    )
    const kvm = qemu === undefined ? false : yield* kvmUsable()
    checks.push(
      kvm
        ? { name: "accel", status: "ok", detail: "KVM (a probe VM starts on /dev/kvm)" }
        : {
            name: "accel",
            status: "warn",
            detail: "KVM is not usable here: guests run under TCG (software), several times slower"
          }
    )
  }

  const image = yield* resolveImage(paths.images, undefined).pipe(Effect.either)
  checks.push(
    image._tag === "Right"
      ? {
          name: "image",
          status: "ok",
          detail: `${image.right.meta.name}@${image.right.meta.digest.slice(0, 12)} (${image.right.meta.arch}, kernel ${image.right.meta.kernel}, protocol ${image.right.meta.protocol})`
        }
      : { name: "image", status: "fail", detail: image.left.message }
  )

  yield* Effect.promise(() => fs.mkdir(paths.home, { recursive: true, mode: 0o700 }).catch(() => undefined))
  const space = yield* Effect.promise(() =>
    fs.statfs(paths.home).then(
      (s) => s.bavail * s.bsize,
      () => undefined
    )
  )
  checks.push(
    space === undefined
      ? { name: "disk", status: "warn", detail: `cannot read free space of ${paths.home}` }
      : {
          name: "disk",
          status: space < 4 * GiB ? "warn" : "ok",
          detail: `${(space / GiB).toFixed(1)} GiB free in ${paths.home}${space < 4 * GiB ? " (a session's disk can grow to a few GiB)" : ""}`
        }
  )

  checks.push(...(yield* brokerChecks(paths.homeFile("brokerPolicy"))))

  const report = yield* scrubber.scrub({ dryRun: true })
  const pending = report.findings.filter((f) => f.count > 0).length
  checks.push({
    name: "scrubber",
    status: report.problems.length > 0 || pending > 0 ? "warn" : "ok",
    detail:
      `${report.sessionsScanned} sessions, ${report.filesScanned} files checked` +
      (pending > 0
        ? `; ${pending} file(s) hold leftover secrets (abox scrub removes them)`
        : "; no leftover secrets") +
      (report.problems.length > 0 ? `; ${report.problems.length} file(s) unreadable (abox scrub --json)` : "")
  })
  return checks
})

// ---- abox doctor --boot ---------------------------------------------------------------------

/** the line the initrd's /init writes once it has reopened the console (images/initrd-init.sh) */
export const CONSOLE_READY = "abox-initrd: console ready"

const readHead = (file: string, length: number) =>
  Effect.tryPromise(async () => {
    const handle = await fs.open(file, "r")
    try {
      const head = Buffer.alloc(length)
      const { bytesRead } = await handle.read(head, 0, length, 0)
      return head.subarray(0, bytesRead)
    } finally {
      await handle.close()
    }
  }).pipe(Effect.orElseSucceed(() => Buffer.alloc(0)))

/** the kernel the backend boots, in the format its VMM needs (vfkit: an uncompressed arm64 Image) */
const kernelCheck = (backend: string, kernel: string) =>
  Effect.gen(function* () {
    if (backend === "vz") {
      const booted = yield* uncompressedKernel(kernel, os.tmpdir()).pipe(Effect.either)
      if (booted._tag === "Left")
        return { name: "kernel", status: "fail", detail: booted.left.message } as Check
      const head = yield* readHead(booted.right, 0x40)
      return head.subarray(0x38, 0x3c).toString("latin1") === "ARMd"
        ? ({ name: "kernel", status: "ok", detail: `${booted.right}: an uncompressed arm64 Image` } as Check)
        : ({
            name: "kernel",
            status: "fail",
            detail: `${booted.right} has no arm64 Image magic at 0x38: vfkit refuses a compressed kernel (rebuild the image: docs/macos.md)`
          } as Check)
    }
    const head = yield* readHead(kernel, 0x210)
    return head.length > 0
      ? ({ name: "kernel", status: "ok", detail: kernel } as Check)
      : ({ name: "kernel", status: "fail", detail: `${kernel} cannot be read` } as Check)
  })

/** the signature vfkit needs on macOS: the com.apple.security.virtualization entitlement */
const vfkitCheck = (wanted: string) =>
  Effect.gen(function* () {
    const found = findExecutable(wanted, ["/opt/homebrew/bin", "/usr/local/bin"])
    if (found === undefined)
      return {
        name: "vfkit",
        status: "fail",
        detail: `${wanted} not found: brew install vfkit (docs/macos.md)`
      } as Check
    const version = (yield* probe(found, ["--version"])) ?? "version unknown"
    if (process.platform !== "darwin")
      return {
        name: "vfkit",
        status: "ok",
        detail: `${found} (${version}; not macOS: signature not checked)`
      } as Check
    const signature = yield* output("codesign", ["-d", "--entitlements", "-", "--xml", found])
    const entitlements =
      signature === undefined ? "" : `${signature.stdout.toString("utf8")}${signature.stderr}`
    return entitlements.includes("com.apple.security.virtualization")
      ? ({
          name: "vfkit",
          status: "ok",
          detail: `${found} (${version}), signed with the virtualization entitlement`
        } as Check)
      : ({
          name: "vfkit",
          status: "fail",
          detail: `${found} (${version}) lacks the com.apple.security.virtualization entitlement: codesign --entitlements vf.entitlements -s - ${found}`
        } as Check)
  })

/**
 * `abox doctor --boot`: boots a throwaway VM of the default image on this host's backend and
 * reports each step: the VMM (on macOS: vfkit found and signed), the kernel's format, the disks'
 * alignment, the boot and the guest's hello (over vsock under vfkit), the entropy device, and
 * whether the guest's console reached console.log. A failed boot keeps its directory (console.log,
 * vfkit.log) and names it: what to send with a report (docs/macos.md).
 */
export const doctorBoot = Effect.fn("doctor.boot")(function* (options: { readonly vfkit?: string } = {}) {
  const vmm = yield* VmmBackend
  const rpc = yield* GuestRpc
  const images = yield* Images
  const checks: Array<Check> = [{ name: "backend", status: "ok", detail: `${vmm.name} (${vmm.arch} guests)` }]
  if (vmm.name === "vz") {
    const vfkit = yield* vfkitCheck(options.vfkit ?? "vfkit")
    checks.push(vfkit)
    if (vfkit.status === "fail") return checks
  }
  const image = yield* images.resolve(undefined).pipe(Effect.either)
  if (image._tag === "Left") {
    checks.push({ name: "image", status: "fail", detail: image.left.message })
    return checks
  }
  const golden = image.right
  checks.push({
    name: "image",
    status: "ok",
    detail: `${golden.identity.name}@${golden.identity.digest.slice(0, 12)}`
  })
  const kernel = yield* kernelCheck(vmm.name, golden.kernel)
  checks.push(kernel)
  if (kernel.status === "fail") return checks

  const dir = yield* Effect.tryPromise(() => fs.mkdtemp(path.join(os.tmpdir(), "abox-doctor-"))).pipe(
    Effect.orDie
  )
  const paths = {
    configDisk: path.join(dir, "config.raw"),
    consoleLog: path.join(dir, "console.log"),
    rpcSocket: rpcSocketPath(dir, process.platform)
  }
  const booted = yield* Effect.scoped(
    Effect.gen(function* () {
      // the root disk a session of this backend gets (a qcow2 overlay on QEMU, a raw clone under vz)
      const root = yield* images.cloneRoot(golden, dir, vmm.rootDiskFormat === "qcow2")
      const files = { ...paths, rootDisk: root.file, rootDiskFormat: root.info.format }
      yield* writeConfigDisk(files.configDisk, { format: 1, sessionId: path.basename(dir), model: "doctor" })
      // vfkit reads raw disks, and refuses a size that is not whole 512-byte sectors; a qcow2
      // overlay (QEMU) has a virtual size of the golden's, its file's own size does not matter
      const rawDisks = root.info.format === "raw" ? [files.rootDisk, files.configDisk] : [files.configDisk]
      const sizes = yield* Effect.tryPromise(() =>
        Promise.all(rawDisks.map((file) => fs.stat(file).then((s) => s.size)))
      ).pipe(Effect.orElseSucceed(() => [] as Array<number>))
      const odd = sizes.filter((size) => size % 512 !== 0)
      const described = rawDisks.map((file, i) => `${path.basename(file)} ${sizes[i]} bytes`).join(", ")
      checks.push(
        sizes.length === rawDisks.length && odd.length === 0
          ? {
              name: "disks",
              status: "ok",
              detail: `${described}: whole 512-byte sectors${root.info.format === "qcow2" ? "; root.qcow2 an overlay of the golden" : ""}`
            }
          : {
              name: "disks",
              status: "fail",
              detail: `a disk size is not a multiple of 512 (${described}): vfkit refuses it`
            }
      )
      yield* ensureSocketDir(files.rpcSocket).pipe(Effect.orDie)
      const listener = yield* rpc.listen(files.rpcSocket, {
        helloTimeout: "180 seconds",
        shutdownTimeout: "15 seconds"
      })
      const started = Date.now()
      const vm = yield* vmm.start({
        sessionId: path.basename(dir),
        sessionDir: dir,
        arch: golden.arch,
        kernel: golden.kernel,
        initrd: golden.initrd,
        ...files,
        cpus: 1,
        memoryMiB: 512,
        lockFd: -1,
        bounds: { graceful: "15 seconds", signalled: "5 seconds", killed: "5 seconds" }
      })
      const died = vm.exited.pipe(
        Effect.flatMap((exit) =>
          Effect.fail(
            `the VM exited before the guest said hello (exit ${exit.exitCode ?? exit.signal}); ${earlyExitReport(files.consoleLog, vm.vmmLog, (line) => stripTerminalControls(line).slice(0, 200))}`
          )
        )
      )
      const connection = yield* Effect.raceFirst(
        listener.accept.pipe(Effect.mapError((error) => error.message)),
        died
      )
      const hello = connection.hello
      checks.push({
        name: "hello",
        status: "ok",
        detail: `${hello.build}, protocol ${hello.protocol}, ${hello.arch}, after ${((Date.now() - started) / 1000).toFixed(1)} s${vmm.name === "vz" ? " (over vsock port 1024)" : ""}`
      })
      const rng = yield* Stream.runCollect(connection.turn("cat /sys/class/misc/hw_random/rng_current")).pipe(
        Effect.map((events) =>
          Chunk.toReadonlyArray(events)
            .map((e) => (e._tag === "Event" && e.event.kind === "stdout" ? e.event.data : ""))
            .join("")
            .trim()
        ),
        Effect.orElseSucceed(() => "")
      )
      // both backends attach a virtio-rng device (vfkit --device virtio-rng, QEMU virtio-rng-pci)
      checks.push(
        rng.startsWith("virtio_rng")
          ? { name: "entropy", status: "ok", detail: `the kernel's rng is ${rng}` }
          : {
              name: "entropy",
              status: "warn",
              detail: `the kernel's rng is ${rng || "unknown"}, not the virtio-rng device (an image built before its initrd loaded virtio-rng)`
            }
      )
      return true
    })
  ).pipe(
    Effect.catchAll((error) =>
      Effect.sync(() => {
        checks.push({
          name: "boot",
          status: "fail",
          detail: typeof error === "string" ? error : error.message
        })
        return false
      })
    )
  )
  const consoleText = yield* Effect.tryPromise(() => fs.readFile(paths.consoleLog, "utf8")).pipe(
    Effect.orElseSucceed(() => "")
  )
  checks.push(
    consoleText.includes(CONSOLE_READY)
      ? {
          name: "console",
          status: "ok",
          detail: `the guest's console reached console.log ("${CONSOLE_READY}")`
        }
      : {
          name: "console",
          status: booted ? "warn" : "fail",
          detail: `no "${CONSOLE_READY}" in console.log: the guest's console is lost (an image built before its initrd reopened the console, or no console device)`
        }
  )
  if (booted) yield* Effect.tryPromise(() => fs.rm(dir, { recursive: true, force: true })).pipe(Effect.ignore)
  else
    checks.push({
      name: "logs",
      status: "warn",
      detail: `kept in ${dir} (console.log${vmm.name === "vz" ? ", vfkit.log" : ""}): send them with a report`
    })
  return checks
})
