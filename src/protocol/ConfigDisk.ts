import { createHash } from "node:crypto"
import * as Either from "effect/Either"
import * as ParseResult from "effect/ParseResult"
import * as Schema from "effect/Schema"
import { GuestConfig } from "./GuestConfig.js"

/**
 * The sealed config disk (`config.raw`, attached read-only as /dev/vdb). Layout, all integers
 * big-endian (docs/on-disk.md):
 *
 *   0   8  magic "ABOXCFG\0"
 *   8   4  layout version (1)
 *   12  4  JSON length n
 *   16  32 SHA-256 of the JSON bytes
 *   48  n  JSON (GuestConfig, UTF-8)
 *   ...    zero padding to a multiple of 4096 bytes (whole sectors for every VMM)
 */
export const CONFIG_DISK_MAGIC = Buffer.from("ABOXCFG\0", "latin1")
export const CONFIG_DISK_LAYOUT = 1
export const CONFIG_DISK_HEADER = 48
export const CONFIG_DISK_ALIGN = 4096
/** a config is small; anything bigger is not ours */
export const CONFIG_DISK_MAX_JSON = 1024 * 1024

export type ConfigDiskProblem =
  | { readonly _tag: "BadMagic" }
  | { readonly _tag: "UnsupportedLayout"; readonly layout: number }
  | { readonly _tag: "BadLength"; readonly length: number }
  | { readonly _tag: "ChecksumMismatch" }
  | { readonly _tag: "InvalidConfig"; readonly reason: string }

export const describeConfigDiskProblem = (problem: ConfigDiskProblem): string => {
  switch (problem._tag) {
    case "BadMagic":
      return "not an abox config disk (bad magic)"
    case "UnsupportedLayout":
      return `config disk layout ${problem.layout} is not supported (this build reads ${CONFIG_DISK_LAYOUT})`
    case "BadLength":
      return `config disk declares ${problem.length} bytes of JSON, more than it holds or allows`
    case "ChecksumMismatch":
      return "config disk checksum does not match its content"
    case "InvalidConfig":
      return `config disk content is not a valid guest config: ${problem.reason}`
  }
}

const encodeConfigJson = Schema.encodeSync(Schema.parseJson(GuestConfig))
const decodeConfigJson = Schema.decodeUnknownEither(Schema.parseJson(GuestConfig))

export const encodeConfigDisk = (config: GuestConfig): Buffer => {
  const json = Buffer.from(encodeConfigJson(config), "utf8")
  const size = Math.ceil((CONFIG_DISK_HEADER + json.length) / CONFIG_DISK_ALIGN) * CONFIG_DISK_ALIGN
  const disk = Buffer.alloc(size)
  CONFIG_DISK_MAGIC.copy(disk, 0)
  disk.writeUInt32BE(CONFIG_DISK_LAYOUT, 8)
  disk.writeUInt32BE(json.length, 12)
  createHash("sha256").update(json).digest().copy(disk, 16)
  json.copy(disk, CONFIG_DISK_HEADER)
  return disk
}

export const decodeConfigDisk = (disk: Uint8Array): Either.Either<GuestConfig, ConfigDiskProblem> => {
  const bytes = Buffer.from(disk.buffer, disk.byteOffset, disk.byteLength)
  if (bytes.length < CONFIG_DISK_HEADER || !bytes.subarray(0, 8).equals(CONFIG_DISK_MAGIC)) {
    return Either.left({ _tag: "BadMagic" })
  }
  const layout = bytes.readUInt32BE(8)
  if (layout !== CONFIG_DISK_LAYOUT) return Either.left({ _tag: "UnsupportedLayout", layout })
  const length = bytes.readUInt32BE(12)
  if (length > CONFIG_DISK_MAX_JSON || CONFIG_DISK_HEADER + length > bytes.length) {
    return Either.left({ _tag: "BadLength", length })
  }
  const json = bytes.subarray(CONFIG_DISK_HEADER, CONFIG_DISK_HEADER + length)
  if (!createHash("sha256").update(json).digest().equals(bytes.subarray(16, 48))) {
    return Either.left({ _tag: "ChecksumMismatch" })
  }
  return Either.mapLeft(decodeConfigJson(json.toString("utf8")), (error) => ({
    _tag: "InvalidConfig" as const,
    reason: ParseResult.TreeFormatter.formatErrorSync(error)
  }))
}
