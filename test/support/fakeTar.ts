/**
 * A hand-written ustar writer for hostile archives: `tar`'s own packer refuses to write most of
 * what the guest must refuse to extract (absolute paths, `..`, links out of the tree, devices).
 */
export interface FakeTarEntry {
  readonly path: string
  /** '0' file, '1' hard link, '2' symlink, '3' char device, '5' directory, '6' FIFO */
  readonly type?: "0" | "1" | "2" | "3" | "5" | "6"
  readonly linkpath?: string
  readonly mode?: number
  readonly data?: string | Uint8Array
  readonly uid?: number
  readonly gid?: number
  /** the size the header declares, when it is not the data's (a size bomb) */
  readonly declaredSize?: number
}

const BLOCK = 512

const writeString = (header: Buffer, offset: number, length: number, value: string) => {
  const bytes = Buffer.from(value, "utf8")
  if (bytes.length > length) throw new Error(`tar field too long: ${value}`)
  bytes.copy(header, offset)
}

const writeOctal = (header: Buffer, offset: number, length: number, value: number) => {
  writeString(header, offset, length, value.toString(8).padStart(length - 1, "0") + "\0")
}

export const tarHeader = (entry: FakeTarEntry, size: number): Buffer => {
  const header = Buffer.alloc(BLOCK)
  writeString(header, 0, 100, entry.path)
  writeOctal(header, 100, 8, entry.mode ?? (entry.type === "5" ? 0o755 : 0o644))
  writeOctal(header, 108, 8, entry.uid ?? 0)
  writeOctal(header, 116, 8, entry.gid ?? 0)
  writeOctal(header, 124, 12, size)
  writeOctal(header, 136, 12, Math.floor(Date.now() / 1000))
  header.fill(" ", 148, 156)
  writeString(header, 156, 1, entry.type ?? "0")
  writeString(header, 157, 100, entry.linkpath ?? "")
  writeString(header, 257, 6, "ustar\0")
  writeString(header, 263, 2, "00")
  let sum = 0
  for (const byte of header) sum += byte
  writeString(header, 148, 8, sum.toString(8).padStart(6, "0") + "\0 ")
  return header
}

export const fakeTar = (entries: ReadonlyArray<FakeTarEntry>): Buffer => {
  const parts: Array<Buffer> = []
  for (const entry of entries) {
    const data = entry.data === undefined ? Buffer.alloc(0) : Buffer.from(entry.data)
    const size = entry.type === undefined || entry.type === "0" ? data.length : 0
    parts.push(tarHeader(entry, entry.declaredSize ?? size))
    if (size > 0) {
      parts.push(data)
      const pad = (BLOCK - (size % BLOCK)) % BLOCK
      if (pad > 0) parts.push(Buffer.alloc(pad))
    }
  }
  parts.push(Buffer.alloc(2 * BLOCK))
  return Buffer.concat(parts)
}

/** the archive as a stream of small, unaligned chunks (as frames arrive) */
export async function* chunked(bytes: Uint8Array, size = 777): AsyncGenerator<Uint8Array> {
  for (let offset = 0; offset < bytes.length; offset += size) {
    yield bytes.subarray(offset, offset + size)
    await Promise.resolve()
  }
}
