/**
 * OCI images built in a test: layer tars (test/support/fakeTar.ts) made into an OCI layout
 * (image-spec image-layout.md), an `oci-archive` (a tar of it) or a `docker save` archive
 * (manifest.json, `<hex>.json` config, `<id>/layer.tar`), with real digests throughout.
 */
import * as crypto from "node:crypto"
import * as zlib from "node:zlib"
import { fakeTar, type FakeTarEntry } from "./fakeTar.js"

const sha = (bytes: Uint8Array) => crypto.createHash("sha256").update(bytes).digest("hex")

export interface TestImage {
  readonly layers: ReadonlyArray<ReadonlyArray<FakeTarEntry>>
  /** which layers are gzipped (OCI only) */
  readonly gzip?: ReadonlyArray<boolean>
  readonly env?: ReadonlyArray<string>
  readonly workingDir?: string
  readonly user?: string
  /** the reference the archive names */
  readonly reference?: string
  readonly architecture?: string
  /** the config's diff_ids, when not the layers' own digests */
  readonly diffIds?: ReadonlyArray<string>
}

const configOf = (image: TestImage, tars: ReadonlyArray<Buffer>) =>
  Buffer.from(
    JSON.stringify({
      architecture: image.architecture ?? "amd64",
      os: "linux",
      config: { Env: image.env ?? [], WorkingDir: image.workingDir ?? "", User: image.user ?? "" },
      rootfs: { type: "layers", diff_ids: image.diffIds ?? tars.map((tar) => `sha256:${sha(tar)}`) }
    })
  )

/** the files of an OCI layout: path → bytes (directories implied) */
export const ociLayout = (image: TestImage): Map<string, Buffer> => {
  const tars = image.layers.map((entries) => fakeTar(entries))
  const files = new Map<string, Buffer>()
  const add = (bytes: Buffer, mediaType: string) => {
    const hex = sha(bytes)
    files.set(`blobs/sha256/${hex}`, bytes)
    return { mediaType, digest: `sha256:${hex}`, size: bytes.length }
  }
  const layers = tars.map((tar, i) =>
    image.gzip?.[i] === true
      ? add(zlib.gzipSync(tar), "application/vnd.oci.image.layer.v1.tar+gzip")
      : add(tar, "application/vnd.oci.image.layer.v1.tar")
  )
  const config = add(configOf(image, tars), "application/vnd.oci.image.config.v1+json")
  const manifest = add(
    Buffer.from(
      JSON.stringify({
        schemaVersion: 2,
        mediaType: "application/vnd.oci.image.manifest.v1+json",
        config,
        layers
      })
    ),
    "application/vnd.oci.image.manifest.v1+json"
  )
  files.set("oci-layout", Buffer.from(JSON.stringify({ imageLayoutVersion: "1.0.0" })))
  files.set(
    "index.json",
    Buffer.from(
      JSON.stringify({
        schemaVersion: 2,
        manifests: [
          {
            ...manifest,
            ...(image.reference === undefined
              ? {}
              : {
                  annotations: {
                    "io.containerd.image.name": image.reference,
                    "org.opencontainers.image.ref.name": image.reference.split(":").pop()!
                  }
                })
          }
        ]
      })
    )
  )
  return files
}

/** the files of a `docker save` archive */
export const dockerLayout = (image: TestImage): Map<string, Buffer> => {
  const tars = image.layers.map((entries) => fakeTar(entries))
  const files = new Map<string, Buffer>()
  const config = configOf(image, tars)
  const configName = `${sha(config)}.json`
  files.set(configName, config)
  const layerNames = tars.map((tar) => {
    const name = `${sha(tar)}/layer.tar`
    files.set(name, tar)
    return name
  })
  files.set(
    "manifest.json",
    Buffer.from(
      JSON.stringify([
        {
          Config: configName,
          RepoTags: image.reference === undefined ? null : [image.reference],
          Layers: layerNames
        }
      ])
    )
  )
  return files
}

/** a tar of a layout's files (their directories first) */
export const archiveOf = (files: Map<string, Buffer>, extra: ReadonlyArray<FakeTarEntry> = []): Buffer => {
  const dirs = new Set<string>()
  for (const name of files.keys()) {
    const parts = name.split("/")
    for (let i = 1; i < parts.length; i++) dirs.add(parts.slice(0, i).join("/"))
  }
  return fakeTar([
    ...[...dirs].sort().map((dir): FakeTarEntry => ({ path: `${dir}/`, type: "5" })),
    ...[...files].map(([name, data]): FakeTarEntry => ({ path: name, data })),
    ...extra
  ])
}

/**
 * The image the import tests use: busybox (the host's static one) in a first layer with files of
 * every kind kept (an owner and mode, setuid, a hard link, a symlink, a FIFO), and a second layer
 * (gzipped in the OCI form) that whites one file and one directory out, makes `opq` opaque and
 * adds its own files.
 */
export const sampleImage = (busybox: Buffer, reference = "oci-test:1"): TestImage => ({
  reference,
  env: ["PATH=/bin", "OCI_GREETING=hello from the image"],
  workingDir: "/srv",
  user: "1234",
  gzip: [false, true],
  layers: [
    [
      { path: "bin/", type: "5" },
      { path: "bin/busybox", mode: 0o755, data: busybox },
      ...["sh", "cat", "ls", "stat", "readlink", "echo", "test", "id", "env", "printf"].map(
        (name): FakeTarEntry => ({ path: `bin/${name}`, type: "2", linkpath: "busybox" })
      ),
      { path: "etc/", type: "5" },
      { path: "etc/passwd", data: "root:x:0:0:root:/root:/bin/sh\n" },
      { path: "etc/group", data: "root:x:0:\n" },
      { path: "srv/", type: "5", mode: 0o750, uid: 1234, gid: 2345 },
      { path: "gone.txt", data: "lower\n" },
      { path: "dir-gone/", type: "5" },
      { path: "dir-gone/x", data: "x\n" },
      { path: "opq/", type: "5" },
      { path: "opq/lower.txt", data: "lower\n" },
      { path: "owned.txt", mode: 0o640, uid: 1234, gid: 2345, data: "owned\n" },
      { path: "suid", mode: 0o4755, data: "#!/bin/sh\n" },
      { path: "hardsrc", data: "same inode\n" },
      { path: "hard", type: "1", linkpath: "hardsrc" },
      { path: "link", type: "2", linkpath: "owned.txt" },
      { path: "fifo", type: "6", mode: 0o600 }
    ],
    [
      { path: ".wh.gone.txt" },
      { path: ".wh.dir-gone" },
      { path: "opq/", type: "5" },
      { path: "opq/.wh..wh..opq" },
      { path: "opq/upper.txt", data: "upper\n" },
      { path: "top.txt", data: "from the top layer\n" }
    ]
  ]
})
