/**
 * `abox image import <archive|dir[:tag]>`: an OCI image becomes a golden image (docs/images.md).
 * The archive is untrusted input: it is unpacked with the checked tar reader into a staging
 * directory inside the registry, its documents decoded and its blobs' digests checked
 * (src/lib/oci/layout.ts), its layers applied and its root disk made (src/lib/oci/rootfs.ts);
 * only then is the staging directory registered, in one rename. Any refusal or failure removes
 * the staging directory: nothing is half registered.
 */
import * as Effect from "effect/Effect"
import * as crypto from "node:crypto"
import { createReadStream } from "node:fs"
// Raw node:fs: the staging directory (made, removed) and the kernel files copied into it.
import * as fs from "node:fs/promises"
import * as path from "node:path"
import * as zlib from "node:zlib"
import { AboxPaths } from "../services/AboxPaths.js"
import { IMAGE_NAME, type ImageSource, type RegisteredImage } from "../domain/image.js"
import { IMAGE_FILES, KERNEL_IMAGE_FILE } from "../domain/sessionLayout.js"
import { errorMessage } from "../domain/errorMessage.js"
import { normalizeReference, registerImage, resolveImage } from "../lib/images.js"
import { ExtractError, extractTar } from "../guest/extract.js"
import { escapeControl } from "../lib/text.js"
import { type ArchiveFormat, readImagePlan, refuse } from "../lib/oci/layout.js"
import {
  addRuntime,
  applyLayers,
  DEFAULT_IMPORT_LIMITS,
  type ImportLimits,
  makeRootDisk,
  measured
} from "../lib/oci/rootfs.js"
import { ImageBuildFailed } from "./image.js"

export interface ImportOptions {
  /** an oci-archive or docker save tar (gzip too), or an OCI layout directory (`dir:tag`) */
  readonly source: string
  readonly name?: string | undefined
  /** which manifest of an index (or image of a docker save archive) */
  readonly tag?: string | undefined
  /** the reference recorded (default: the one the archive names) */
  readonly reference?: string | undefined
  /** the abox image whose kernel, initrd, agent and runtime it gets (default `abox`, a small image) */
  readonly base?: string | undefined
  readonly limits?: ImportLimits | undefined
}

const OCI_ARCH = { x86_64: "amd64", aarch64: "arm64" } as const

/** `16G`, `512M`, `4096` (bytes) */
export const parseSize = (text: string): number | undefined => {
  const m = /^(\d+)([KMGT]?)i?B?$/i.exec(text.trim())
  if (m === null) return undefined
  const unit = { "": 1, K: 1024, M: 1024 ** 2, G: 1024 ** 3, T: 1024 ** 4 }[
    m[2]!.toUpperCase() as "" | "K" | "M" | "G" | "T"
  ]
  return Number(m[1]) * unit
}

/** the name an import gets without --name: the reference's last component (`node` for `node:20`) */
const nameFrom = (reference: string | undefined): string => {
  if (reference === undefined) return "imported"
  const last = reference.split("@")[0]!.split("/").pop()!.split(":")[0]!
  const name = last.replace(/[^A-Za-z0-9_-]/g, "-").slice(0, 64)
  return IMAGE_NAME.test(name) ? name : "imported"
}

/** the source's path and tag: `dir:tag` names a tag of a layout directory when `dir:tag` is no path itself */
const splitSource = (source: string, tag: string | undefined) =>
  Effect.promise(async () => {
    const exists = (p: string) =>
      fs.stat(p).then(
        (s) => s,
        () => undefined
      )
    const whole = await exists(source)
    if (whole !== undefined || !source.includes(":")) return { file: source, tag, stat: whole }
    const at = source.lastIndexOf(":")
    const dir = source.slice(0, at)
    return { file: dir, tag: tag ?? source.slice(at + 1), stat: await exists(dir) }
  })

/** the archive's bytes, gunzipped when it is a gzip (`docker save | gzip`) */
const archiveBytes = async (file: string): Promise<AsyncIterable<Buffer>> => {
  const handle = await fs.open(file, "r")
  const head = Buffer.alloc(2)
  try {
    await handle.read(head, 0, 2, 0)
  } finally {
    await handle.close()
  }
  const raw = createReadStream(file, { highWaterMark: 1024 * 1024 })
  return head[0] === 0x1f && head[1] === 0x8b ? raw.pipe(zlib.createGunzip()) : raw
}

export const importImage = Effect.fn("image.import")(function* (options: ImportOptions) {
  const paths = yield* AboxPaths
  const limits = options.limits ?? DEFAULT_IMPORT_LIMITS
  if (options.name !== undefined && !IMAGE_NAME.test(options.name))
    return yield* new ImageBuildFailed({
      step: "name",
      message: `image name ${JSON.stringify(options.name)}: letters, digits, _ and - (1–64)`
    })
  const base = yield* resolveImage(paths.images, options.base ?? "abox")
  if (base.meta.variant !== "small")
    return yield* new ImageBuildFailed({
      step: "base",
      message: `the base image ${base.meta.name} is a ${base.meta.variant} image: a small one (abox image build) carries the runtime an import takes`
    })
  const source = yield* splitSource(path.resolve(options.source), options.tag)
  if (source.stat === undefined)
    return yield* refuse("missing", `${escapeControl(options.source)}: no such file or directory`)

  const staging = path.join(paths.images, `.import-${crypto.randomBytes(6).toString("hex")}`)
  const work = path.join(paths.images, `.import-work-${crypto.randomBytes(6).toString("hex")}`)
  const io = <A>(step: string, run: () => Promise<A>) =>
    Effect.tryPromise({
      try: run,
      catch: (cause) => new ImageBuildFailed({ step, message: errorMessage(cause) })
    })
  yield* io("staging", async () => {
    await fs.mkdir(staging, { recursive: true, mode: 0o700 })
    await fs.mkdir(work, { recursive: true, mode: 0o700 })
  })
  const removeWork = Effect.promise(() =>
    fs.rm(work, { recursive: true, force: true }).catch(() => undefined)
  )
  const removeStaging = Effect.promise(() =>
    fs.rm(staging, { recursive: true, force: true }).catch(() => undefined)
  )

  return yield* Effect.gen(function* () {
    let layoutDir = source.file
    let format: ArchiveFormat = "oci-layout"
    if (!source.stat!.isDirectory()) {
      // the archive unpacked by the checked reader: links stay inside it, no device or FIFO
      layoutDir = path.join(work, "archive")
      yield* Effect.tryPromise({
        try: async () =>
          // bounded as it is read too: a gzip of endless tar padding is stopped
          extractTar(
            measured(await archiveBytes(source.file), undefined, limits.maxBytes + 64 * 1024 * 1024),
            layoutDir,
            {
              untrusted: { maxBytes: limits.maxBytes, maxEntries: 100_000, linksWithin: [] }
            }
          ),
        catch: (cause) =>
          refuse(
            "archive",
            `the archive was refused: ${escapeControl(cause instanceof ExtractError ? cause.reason : errorMessage(cause))}`
          )
      })
      format = "oci-archive"
    }
    const plan = yield* readImagePlan(layoutDir, {
      format: format === "oci-layout" ? "oci-layout" : "oci-archive",
      tag: source.tag,
      arch: base.meta.arch
    })
    const wantArch = OCI_ARCH[base.meta.arch]
    if (plan.config.architecture !== undefined && plan.config.architecture !== wantArch)
      return yield* refuse(
        "platform",
        `the image is for ${plan.config.architecture}, the base image ${base.meta.name} for ${wantArch}`
      )
    if (plan.config.os !== undefined && plan.config.os !== "linux")
      return yield* refuse("platform", `the image is for ${plan.config.os}, not linux`)

    const root = path.join(work, "root")
    yield* io("root", () => fs.mkdir(root, { mode: 0o755 }))
    const recorded = yield* applyLayers(root, plan.layers, limits)
    const golden = path.join(base.dir, base.meta.files.root.file)
    yield* addRuntime({ root, work, baseRoot: golden, arch: base.meta.arch, config: plan.config, recorded })
    yield* makeRootDisk(root, recorded, path.join(staging, IMAGE_FILES.root)).pipe(
      Effect.catchTag("DiskError", (error) =>
        Effect.fail(new ImageBuildFailed({ step: "root disk", message: error.message }))
      )
    )
    yield* io("kernel", async () => {
      await fs.copyFile(
        path.join(base.dir, base.meta.files.kernel.file),
        path.join(staging, IMAGE_FILES.kernel)
      )
      await fs.copyFile(
        path.join(base.dir, base.meta.files.initrd.file),
        path.join(staging, IMAGE_FILES.initrd)
      )
      if (base.meta.files.kernelImage !== undefined)
        await fs.copyFile(
          path.join(base.dir, base.meta.files.kernelImage.file),
          path.join(staging, KERNEL_IMAGE_FILE)
        )
      for (const file of await fs.readdir(staging)) await fs.chmod(path.join(staging, file), 0o644)
    })
    yield* removeWork
    const archived = options.reference ?? plan.reference
    // a bare tag (`20`, an OCI ref.name) is no reference
    const reference =
      archived !== undefined && /[:/@]/.test(archived) ? normalizeReference(archived) : undefined
    const config = plan.config.config ?? undefined
    const sourceMeta: ImageSource = {
      kind: "oci",
      format: plan.format === "docker-archive" ? "docker-archive" : format,
      ...(reference === undefined ? {} : { reference }),
      ...(plan.manifestDigest === undefined ? {} : { manifest: plan.manifestDigest }),
      config: plan.configDigest,
      layers: plan.layers.length,
      env: [...(config?.Env ?? [])],
      ...(config?.WorkingDir === undefined || config.WorkingDir === null || config.WorkingDir === ""
        ? {}
        : { workingDir: config.WorkingDir }),
      ...(config?.User === undefined || config.User === null || config.User === ""
        ? {}
        : { user: config.User }),
      base: `${base.meta.name}@${base.meta.digest}`
    }
    const registered: RegisteredImage = yield* registerImage(
      paths.images,
      staging,
      {
        name: options.name ?? nameFrom(reference),
        variant: "oci",
        arch: base.meta.arch,
        kernel: base.meta.kernel,
        node: base.meta.node,
        agent: base.meta.agent,
        protocol: base.meta.protocol
      },
      { makeDefault: false, agentStart: base.meta.agentStart, source: sourceMeta }
    ).pipe(
      Effect.catchTag("DiskError", (error) =>
        Effect.fail(new ImageBuildFailed({ step: "register", message: error.message }))
      )
    )
    return registered
  }).pipe(
    Effect.ensuring(removeWork),
    Effect.onError(() => removeStaging)
  )
})
