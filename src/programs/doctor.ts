import * as Effect from "effect/Effect"
import { execFile } from "node:child_process"
import * as fs from "node:fs/promises"
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

// Raw node:child_process: a version probe needs nothing more than execFile with a timeout.
const probe = (command: string, args: ReadonlyArray<string>) =>
  Effect.async<string | undefined>((resume) => {
    const child = execFile(command, [...args], { timeout: 10_000 }, (error, stdout) =>
      resume(Effect.succeed(error === null ? stdout.split("\n")[0]?.trim() : undefined))
    )
    return Effect.sync(() => child.kill())
  })

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
