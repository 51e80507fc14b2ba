/**
 * Project environments (docs/environments.md): Open on a repository that brings
 * `.abox/environment.json` (or `.devcontainer/devcontainer.json`) boots its environment image,
 * built once from the base image by its setup script run as root, and reused until the base, the
 * script or the file changes; `abox env build|list|rm` manage them.
 *
 * A repository cannot widen its own egress: the hosts it asks for (`allow`) are granted only by
 * the user (the policy already allows them, `--allow-env-hosts`, or a yes on the terminal), and
 * the setup VM's broker carries the user's policy and those grants alone (no model provider rule,
 * so no credential the user did not give that host).
 */
import * as Clock from "effect/Clock"
import * as Effect from "effect/Effect"
import * as Ref from "effect/Ref"
import * as crypto from "node:crypto"
import * as fs from "node:fs/promises"
import * as path from "node:path"
import { type BrokerPolicy, decide, withRules } from "../broker/policy.js"
import { EnvironmentSetupFailed, type EnvironmentRecord } from "../domain/environment.js"
import { errorMessage } from "../domain/errorMessage.js"
import { DiskError, ImageNotFound, type RegisteredImage } from "../domain/image.js"
import { IMAGE_FILES, SESSION_FILES } from "../domain/sessionLayout.js"
import {
  environmentImageName,
  environmentKey,
  readEnvironment,
  type RepoEnvironment
} from "../lib/environment.js"
import { listImages, registerImage, resolveImage } from "../lib/images.js"
import { AboxPaths } from "../services/AboxPaths.js"
import type { TurnEvent } from "../services/GuestRpc.js"
import { imageRemove } from "./image.js"
import { remove } from "./remove.js"
import {
  type BootOptions,
  defaultPolicy,
  open,
  type OpenOptions,
  runCollecting
} from "./session.js"

export interface EnvironmentOptions {
  /** grant every host the environment requests (`--allow-env-hosts`) */
  readonly allowEnvHosts?: boolean | undefined
  /** the terminal's question: may the repository reach these hosts? (absent: no terminal) */
  readonly consentHosts?: ((hosts: ReadonlyArray<string>) => Effect.Effect<boolean>) | undefined
  /** the setup's output as it comes (the install's goes to `onInstallOutput`) */
  readonly onSetupOutput?: ((event: TurnEvent) => Effect.Effect<void>) | undefined
  /** a line for the user: hosts not granted, devcontainer fields ignored, an image being built */
  readonly onNotice?: ((line: string) => Effect.Effect<void>) | undefined
}

const notice = (options: EnvironmentOptions, line: string) => options.onNotice?.(line) ?? Effect.void

/** image names are `[A-Za-z0-9_-]`: a reference's other characters become `_` (as session names) */
const referenceName = (reference: string): string => reference.replace(/[^A-Za-z0-9_-]/g, "_").slice(0, 64)

/**
 * The environment's base image: a registered name or name@digest; a devcontainer's `image`, an
 * image imported under that reference (its name, or the reference its image.json records).
 */
export const environmentBase = Effect.fn("environment.base")(function* (environment: RepoEnvironment) {
  const paths = yield* AboxPaths
  const reference = environment.imageReference
  if (reference === undefined) return yield* resolveImage(paths.images, environment.base)
  const { images } = yield* listImages(paths.images)
  const found = images.find(
    (image) =>
      image.meta.environment === undefined &&
      (image.meta.source?.reference === reference ||
        image.meta.name === reference ||
        image.meta.name === referenceName(reference))
  )
  if (found !== undefined) return found
  return yield* new ImageNotFound({
    ref: reference,
    message: `${environment.file} names the image ${reference}, which is not imported: save it as an archive (skopeo copy docker://${reference} oci-archive:image.tar, or docker save ${reference} -o image.tar) and run abox image import image.tar --name ${referenceName(reference)}`
  })
})

/** the hosts the environment asks for that this user grants, and those left out */
export const grantedHosts = Effect.fn("environment.grant")(function* (
  environment: RepoEnvironment,
  policy: BrokerPolicy,
  options: EnvironmentOptions,
  /** grants recorded with its image (a yes given when it was built) */
  recorded: ReadonlyArray<string> | undefined
) {
  const requested = environment.allow
  if (requested.length === 0) return { granted: [], refused: [] }
  // the user's policy, then what the user granted this environment before
  let granted: ReadonlyArray<string> = requested.filter(
    (host) => decide(policy, host, 443).allow || recorded?.includes(host) === true
  )
  const pending = requested.filter((host) => !granted.includes(host))
  if (pending.length > 0) {
    if (options.allowEnvHosts === true) granted = requested
    else if (options.consentHosts !== undefined && (yield* options.consentHosts(pending))) granted = requested
  }
  const refused = requested.filter((host) => !granted.includes(host))
  if (refused.length > 0) {
    yield* notice(
      options,
      `${environment.file} asks to reach ${refused.join(", ")}: not granted (your broker.json does not allow ${refused.length === 1 ? "it" : "them"}; --allow-env-hosts grants the environment's hosts)`
    )
  }
  return { granted, refused }
})

const withHosts = (policy: BrokerPolicy, hosts: ReadonlyArray<string>): BrokerPolicy =>
  hosts.length === 0
    ? policy
    : withRules(policy, { allow: hosts.map((host) => ({ host, ports: [443] })), credentials: [] })

const diskIo = <A>(file: string, reason: string, run: () => Promise<A>) =>
  Effect.tryPromise({
    try: run,
    catch: (cause) => new DiskError({ path: file, reason, message: `${reason} ${file}: ${errorMessage(cause)}` })
  })

/** a golden file into the staging directory: a hard link (read-only, never written), else a copy */
const linkOrCopy = (from: string, to: string) =>
  diskIo(to, "link", () => fs.link(from, to).catch(() => fs.copyFile(from, to)))

/**
 * The setup: a VM booted from the base image (its root a new overlay) with the repository
 * read-only at /work/repo, the setup command run as root, its output streamed; a non-zero
 * status is `EnvironmentSetupFailed` with its tail and nothing is left. On success the VM is
 * shut down (the guest syncs) and its root disk, an overlay over the base's root.raw, becomes
 * the environment image, registered as `env-<key>`.
 */
export const buildEnvironmentImage = Effect.fn("environment.build")(function* (
  environment: RepoEnvironment,
  base: RegisteredImage,
  key: string,
  policy: BrokerPolicy,
  granted: ReadonlyArray<string>,
  boot: BootOptions,
  options: EnvironmentOptions
) {
  const paths = yield* AboxPaths
  const setup = environment.setup!
  const started = yield* Clock.currentTimeMillis
  yield* notice(options, `building the environment of ${environment.source} (${environment.file}) over ${base.meta.name}`)
  const setupSession = yield* Ref.make<string | undefined>(undefined)
  const removeSetupSession = Ref.get(setupSession).pipe(
    Effect.flatMap((id) => (id === undefined ? Effect.void : Effect.ignore(remove([id]))))
  )
  return yield* Effect.gen(function* () {
    const made = yield* Effect.scoped(
      Effect.gen(function* () {
        const session = yield* open({
          ...boot,
          source: environment.source,
          image: `${base.meta.name}@${base.meta.digest}`,
          policy: withHosts(policy, granted),
          env: environment.env,
          setup: true,
          // the setup is a shell command, never a configured agent's turn
          agent: undefined,
          cpus: boot.cpus ?? environment.cpus,
          memoryMiB: boot.memoryMiB ?? environment.memoryMiB
        })
        yield* Ref.set(setupSession, session.id)
        const result = yield* runCollecting(session, setup.command, options.onSetupOutput)
        if (result.exitCode !== 0) {
          return yield* new EnvironmentSetupFailed({
            source: environment.source,
            exitCode: result.exitCode,
            signal: result.signal,
            logTail: result.tail,
            message: `the environment's setup failed (${result.exitCode === null ? `signal ${result.signal}` : `exit ${result.exitCode}`}); no image was made. The end of its output:\n${result.tail}`
          })
        }
        // the tar path (no repository disk) wrote the repository onto the root disk: not the image's
        yield* runCollecting(
          session,
          "grep -q ' /work/repo ' /proc/mounts || { rm -rf /work/repo && mkdir -p /work/repo; }; sync",
          undefined
        )
        return { dir: session.dir, rootDisk: session.meta.rootDisk }
      })
    )
    // the VM is down: its root disk is whole
    const rootFile = made.rootDisk?.format === "qcow2" ? SESSION_FILES.rootQcow2 : SESSION_FILES.rootDisk
    const staging = path.join(paths.images, `.env-${key.slice(0, 16)}-${crypto.randomBytes(4).toString("hex")}`)
    yield* diskIo(staging, "mkdir", () => fs.mkdir(staging, { recursive: true, mode: 0o700 }))
    return yield* Effect.gen(function* () {
      yield* linkOrCopy(path.join(base.dir, base.meta.files.kernel.file), path.join(staging, IMAGE_FILES.kernel))
      yield* linkOrCopy(path.join(base.dir, base.meta.files.initrd.file), path.join(staging, IMAGE_FILES.initrd))
      if (base.meta.files.kernelImage !== undefined)
        yield* linkOrCopy(path.join(base.dir, base.meta.files.kernelImage.file), path.join(staging, "Image"))
      yield* diskIo(rootFile, "rename", () => fs.rename(path.join(made.dir, rootFile), path.join(staging, rootFile)))
      const stat = yield* diskIo(rootFile, "stat", () => fs.stat(path.join(staging, rootFile)))
      const finished = yield* Clock.currentTimeMillis
      const record: EnvironmentRecord = {
        key,
        base: { name: base.meta.name, digest: base.meta.digest },
        source: environment.source,
        file: environment.file,
        granted: [...granted],
        setupSeconds: Math.round((finished - started) / 100) / 10,
        overlayBytes: stat.blocks * 512
      }
      return yield* registerImage(
        paths.images,
        staging,
        {
          name: environmentImageName(key),
          variant: base.meta.variant,
          arch: base.meta.arch,
          kernel: base.meta.kernel,
          node: base.meta.node,
          agent: base.meta.agent,
          protocol: base.meta.protocol
        },
        { makeDefault: false, agentStart: base.meta.agentStart, rootFile, environment: record }
      )
    }).pipe(Effect.tapError(() => Effect.promise(() => fs.rm(staging, { recursive: true, force: true }))))
  }).pipe(Effect.ensuring(removeSetupSession))
})

/** the registered image of `key`, if it was built */
const builtImage = (key: string) =>
  Effect.gen(function* () {
    const paths = yield* AboxPaths
    const { images } = yield* listImages(paths.images)
    return images.find((image) => image.meta.environment?.key === key)
  })

/**
 * The repository's environment made ready for an Open: its image (built now when it is not yet),
 * the policy with the granted hosts, and what Open applies (env, install, cpus, memory).
 * `undefined` when the repository has no environment.
 */
export const prepareEnvironment = Effect.fn("environment.prepare")(function* (
  source: string,
  boot: BootOptions,
  options: EnvironmentOptions
) {
  const environment = yield* readEnvironment(path.resolve(source))
  if (environment === undefined) return undefined
  if (environment.ignored.length > 0)
    yield* notice(options, `${environment.file}: ignored (abox reads no such field): ${environment.ignored.join(", ")}`)
  const base = yield* environmentBase(environment)
  const policy = boot.policy ?? (yield* defaultPolicy)
  if (environment.setup === undefined) {
    const { granted } = yield* grantedHosts(environment, policy, options, undefined)
    return { environment, image: base, policy: withHosts(policy, granted), built: false }
  }
  const key = environmentKey(base.meta.digest, environment)
  const existing = yield* builtImage(key)
  const { granted } = yield* grantedHosts(environment, policy, options, existing?.meta.environment?.granted)
  const image =
    existing ?? (yield* buildEnvironmentImage(environment, base, key, policy, granted, boot, options))
  return { environment, image, policy: withHosts(policy, granted), built: existing === undefined }
})

/**
 * Open, with the repository's environment unless an image is named (`--image` overrides it):
 * its image, env for turns, cpus and memory (flags win), granted hosts, and its install command
 * run as the repository user once the repository is in.
 */
export const openWithEnvironment = Effect.fn("environment.open")(function* (
  options: OpenOptions & EnvironmentOptions
) {
  if (options.image !== undefined || options.setup === true) return yield* open(options)
  const prepared = yield* prepareEnvironment(options.source, options, options)
  if (prepared === undefined) return yield* open(options)
  const { environment, image } = prepared
  // with --agent every turn is the agent's: the install command would be its input, not a shell's
  const install = options.agent === undefined ? environment.install : undefined
  if (install === undefined && environment.install !== undefined)
    yield* notice(options, `${environment.file}: install not run (with --agent, turns go to the agent): ${environment.install}`)
  return yield* open({
    ...options,
    image: `${image.meta.name}@${image.meta.digest}`,
    policy: prepared.policy,
    env: { ...environment.env, ...options.env },
    install,
    cpus: options.cpus ?? environment.cpus,
    memoryMiB: options.memoryMiB ?? environment.memoryMiB
  })
})

/** `abox env build <dir>`: the environment image, built unless it is already */
export const envBuild = Effect.fn("env.build")(function* (
  source: string,
  boot: BootOptions,
  options: EnvironmentOptions
) {
  const prepared = yield* prepareEnvironment(source, boot, options)
  if (prepared === undefined) {
    return yield* new ImageNotFound({
      ref: source,
      message: `${source} has no environment (.abox/environment.json or .devcontainer/devcontainer.json)`
    })
  }
  return prepared
})

/** `abox env list`: every environment image, newest first */
export const envList = Effect.fn("env.list")(function* () {
  const paths = yield* AboxPaths
  const { images } = yield* listImages(paths.images)
  return images.filter((image) => image.meta.environment !== undefined)
})

/**
 * `abox env rm <dir>`: the environment images built from that repository (every key), each
 * through `abox image rm` (refused while a session uses it)
 */
export const envRemove = Effect.fn("env.rm")(function* (source: string) {
  const resolved = path.resolve(source)
  const images = (yield* envList()).filter((image) => image.meta.environment?.source === resolved)
  if (images.length === 0) {
    return yield* new ImageNotFound({ ref: source, message: `no environment image was built from ${resolved}` })
  }
  const removed: Array<RegisteredImage> = []
  for (const image of images) {
    removed.push((yield* imageRemove(`${image.meta.name}@${image.meta.digest}`, false)).image)
  }
  return removed
})
