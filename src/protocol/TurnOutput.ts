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

/**
 * the records of a channel's bytes as they arrive; throws OutputRecordError on a malformed one.
 * Linear in the bytes however they are cut: a record is copied once at most (not at all when it
 * lies in one chunk).
 */
export class OutputRecordDecoder {
  private pending: Array<Uint8Array> = []
  private pendingBytes = 0
  /** the record being read: its kind and whole size (header included), once its header is in */
  private kind: OutputKind | undefined = undefined
  private need = 0

  push(chunk: Uint8Array): ReadonlyArray<OutputRecord> {
    if (chunk.length > 0) {
      this.pending.push(chunk)
      this.pendingBytes += chunk.length
    }
    const records: Array<OutputRecord> = []
    for (;;) {
      if (this.kind === undefined) {
        if (this.pendingBytes < HEADER) break
        const head = this.peek(HEADER)
        const kindByte = head[0]!
        const kind: OutputKind | undefined = kindByte === 1 ? "stdout" : kindByte === 2 ? "stderr" : undefined
        if (kind === undefined) throw new OutputRecordError(`unknown record kind ${kindByte}`)
        const length = ((head[1]! << 24) | (head[2]! << 16) | (head[3]! << 8) | head[4]!) >>> 0
        if (length === 0 || length > MAX_OUTPUT_RECORD) {
          throw new OutputRecordError(`a record of ${length} bytes (1 to ${MAX_OUTPUT_RECORD})`)
        }
        this.kind = kind
        this.need = HEADER + length
      }
      if (this.pendingBytes < this.need) break
      records.push({ kind: this.kind, bytes: this.take(this.need).subarray(HEADER) })
      this.kind = undefined
    }
    return records
  }

  /** the channel's EOF: a record cut short is an error */
  end(): void {
    if (this.pendingBytes > 0) {
      throw new OutputRecordError(`the channel ended inside a record (${this.pendingBytes} bytes of it)`)
    }
  }

  /** the first `n` pending bytes (n ≤ pendingBytes), left pending */
  private peek(n: number): Uint8Array {
    const first = this.pending[0]!
    if (first.length >= n) return first
    const head = new Uint8Array(n)
    let at = 0
    for (const piece of this.pending) {
      const part = piece.subarray(0, n - at)
      head.set(part, at)
      at += part.length
      if (at === n) break
    }
    return head
  }

  /** removes and returns the first `n` pending bytes (n ≤ pendingBytes) */
  private take(n: number): Uint8Array {
    const first = this.pending[0]!
    let taken: Uint8Array
    if (first.length >= n) {
      taken = first.subarray(0, n)
      if (first.length === n) this.pending.shift()
      else this.pending[0] = first.subarray(n)
    } else {
      taken = new Uint8Array(n)
      let at = 0
      let used = 0
      while (at < n) {
        const piece = this.pending[used]!
        const part = piece.subarray(0, n - at)
        taken.set(part, at)
        at += part.length
        if (part.length === piece.length) used++
        else this.pending[used] = piece.subarray(part.length)
      }
      this.pending = this.pending.slice(used)
    }
    this.pendingBytes -= n
    return taken
  }
}
