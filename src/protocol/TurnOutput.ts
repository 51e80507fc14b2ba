/**
 * A shell turn's output on its data channel (FEATURE_OUTPUT, `user_turn.output`): records of
 * `kind` (1 byte: 1 stdout, 2 stderr), `length` (u32 big-endian) and that many bytes, in the
 * order the turn wrote them, so stdout and stderr keep their interleaving. The bytes are the
 * turn's exactly (no text, no base64); the channel's credit is the back pressure.
 * The guest is untrusted: a decoder rejects an unknown kind, an empty or oversized record, and a
 * record cut by the channel's EOF.
 */

export type OutputKind = "stdout" | "stderr"

/** the largest record a guest sends (and a host accepts) */
export const MAX_OUTPUT_RECORD = 256 * 1024
const HEADER = 5
const KIND_BYTE: Record<OutputKind, number> = { stdout: 1, stderr: 2 }

export interface OutputRecord {
  readonly kind: OutputKind
  readonly bytes: Uint8Array
}

/** a record as it goes on the channel (bytes: 1 to MAX_OUTPUT_RECORD) */
export const encodeOutputRecord = (kind: OutputKind, bytes: Uint8Array): Uint8Array => {
  if (bytes.length === 0 || bytes.length > MAX_OUTPUT_RECORD) {
    throw new RangeError(`an output record holds 1 to ${MAX_OUTPUT_RECORD} bytes, not ${bytes.length}`)
  }
  const record = Buffer.allocUnsafe(HEADER + bytes.length)
  record[0] = KIND_BYTE[kind]
  record.writeUInt32BE(bytes.length, 1)
  record.set(bytes, HEADER)
  return record
}

export class OutputRecordError extends Error {
  constructor(readonly reason: string) {
    super(`turn output channel: ${reason}`)
    this.name = "OutputRecordError"
  }
}

/** the records of a channel's bytes as they arrive; throws OutputRecordError on a malformed one */
export class OutputRecordDecoder {
  private pending: Array<Uint8Array> = []
  private pendingBytes = 0

  push(chunk: Uint8Array): ReadonlyArray<OutputRecord> {
    let bytes: Uint8Array
    if (this.pendingBytes === 0) bytes = chunk
    else {
      this.pending.push(chunk)
      bytes = Buffer.concat(this.pending, this.pendingBytes + chunk.length)
      this.pending = []
      this.pendingBytes = 0
    }
    const records: Array<OutputRecord> = []
    let at = 0
    while (bytes.length - at >= HEADER) {
      const kindByte = bytes[at]!
      const kind: OutputKind | undefined = kindByte === 1 ? "stdout" : kindByte === 2 ? "stderr" : undefined
      if (kind === undefined) throw new OutputRecordError(`unknown record kind ${kindByte}`)
      const length = ((bytes[at + 1]! << 24) | (bytes[at + 2]! << 16) | (bytes[at + 3]! << 8) | bytes[at + 4]!) >>> 0
      if (length === 0 || length > MAX_OUTPUT_RECORD) {
        throw new OutputRecordError(`a record of ${length} bytes (1 to ${MAX_OUTPUT_RECORD})`)
      }
      if (bytes.length - at - HEADER < length) break
      records.push({ kind, bytes: bytes.subarray(at + HEADER, at + HEADER + length) })
      at += HEADER + length
    }
    if (at < bytes.length) {
      // a copy: the rest is at most one record, and the chunk it came in is not kept alive
      const rest = Uint8Array.prototype.slice.call(bytes, at)
      this.pending = [rest]
      this.pendingBytes = rest.length
    }
    return records
  }

  /** the channel's EOF: a record cut short is an error */
  end(): void {
    if (this.pendingBytes > 0) {
      throw new OutputRecordError(`the channel ended inside a record (${this.pendingBytes} bytes of it)`)
    }
  }
}
