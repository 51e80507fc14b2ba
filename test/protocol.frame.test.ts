import { describe, expect, it } from "@effect/vitest"
import * as fc from "fast-check"
import type { Frame } from "../src/protocol/Frame.js"
import {
  decodeCredit,
  encodeCredit,
  encodeFrame,
  FRAME_HEADER_BYTES,
  FrameDecoder,
  FrameError,
  FrameKind,
  MAX_FRAME_PAYLOAD
} from "../src/protocol/Frame.js"

const concat = (parts: ReadonlyArray<Uint8Array>): Uint8Array => {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0))
  let o = 0
  for (const p of parts) {
    out.set(p, o)
    o += p.length
  }
  return out
}

/** any frame v4 allows */
const arbFrame: fc.Arbitrary<Frame> = fc.oneof(
  fc.uint8Array({ maxLength: 300 }).map((payload) => ({ channel: 0, kind: FrameKind.Control, payload })),
  fc
    .tuple(fc.integer({ min: 1, max: 0xffffffff }), fc.uint8Array({ maxLength: 3000 }))
    .map(([channel, payload]) => ({ channel, kind: FrameKind.Data, payload })),
  fc
    .tuple(fc.integer({ min: 1, max: 0xffffffff }), fc.integer({ min: 0, max: 0xffffffff }))
    .map(([channel, n]) => ({ channel, kind: FrameKind.Credit, payload: encodeCredit(n) })),
  fc
    .integer({ min: 1, max: 0xffffffff })
    .map((channel) => ({ channel, kind: FrameKind.Eof, payload: new Uint8Array(0) }))
)

/** cut bytes at the given (sorted, deduplicated) offsets */
const chunk = (bytes: Uint8Array, cuts: ReadonlyArray<number>): Array<Uint8Array> => {
  const points = [...new Set(cuts.map((c) => c % (bytes.length + 1)))].sort((a, b) => a - b)
  const out: Array<Uint8Array> = []
  let prev = 0
  for (const p of points) {
    out.push(bytes.subarray(prev, p))
    prev = p
  }
  out.push(bytes.subarray(prev))
  return out
}

const header = (length: number, channel: number, kind: number): Uint8Array => {
  const h = new Uint8Array(FRAME_HEADER_BYTES)
  const v = new DataView(h.buffer)
  v.setUint32(0, length)
  v.setUint32(4, channel)
  v.setUint8(8, kind)
  return h
}

const errorOf = (f: () => unknown): FrameError => {
  try {
    f()
  } catch (e) {
    if (e instanceof FrameError) return e
    throw e
  }
  throw new Error("expected a FrameError")
}

describe("protocol v4 frames", () => {
  it("lays out a frame as documented (big-endian length, channel, kind, payload)", () => {
    const bytes = encodeFrame({ channel: 2, kind: FrameKind.Data, payload: new Uint8Array([0xaa, 0xbb]) })
    expect(Buffer.from(bytes).toString("hex")).toBe("00000002" + "00000002" + "01" + "aabb")
    expect(Buffer.from(encodeCredit(65536)).toString("hex")).toBe("00010000")
    expect(decodeCredit(encodeCredit(0xfffffffe))).toBe(0xfffffffe)
  })

  it("round-trips random frames through random chunkings of the byte stream", () => {
    fc.assert(
      fc.property(
        fc.array(arbFrame, { maxLength: 20 }),
        fc.array(fc.nat(), { maxLength: 30 }),
        (frames, cuts) => {
          const bytes = concat(frames.map((f) => encodeFrame(f)))
          const decoder = new FrameDecoder()
          const out: Array<Frame> = []
          for (const c of chunk(bytes, cuts)) out.push(...decoder.push(c))
          decoder.finish()
          expect(out.map((f) => ({ ...f, payload: Buffer.from(f.payload).toString("hex") }))).toEqual(
            frames.map((f) => ({ ...f, payload: Buffer.from(f.payload).toString("hex") }))
          )
          expect(decoder.buffered).toBe(0)
        }
      ),
      { numRuns: 300 }
    )
  })

  it("streamData: DATA arrives in zero-copy pieces that add up to the frames; other kinds stay whole", () => {
    fc.assert(
      fc.property(
        fc.array(arbFrame, { maxLength: 20 }),
        fc.array(fc.nat(), { maxLength: 30 }),
        (frames, cuts) => {
          const bytes = concat(frames.map((f) => encodeFrame(f)))
          const decoder = new FrameDecoder({ streamData: true })
          const all: Array<Frame> = []
          for (const c of chunk(bytes, cuts)) all.push(...decoder.push(c))
          decoder.finish()
          expect(decoder.buffered).toBe(0)
          // empty DATA frames carry no bytes: compare without them
          const out = all.filter((f) => f.kind !== FrameKind.Data || f.payload.length > 0)
          // merge consecutive DATA pieces of one channel back into frames of the same sizes
          const expected = frames.filter((f) => f.kind !== FrameKind.Data || f.payload.length > 0)
          const merged: Array<{ channel: number; kind: number; hex: string }> = []
          let i = 0
          for (const f of expected) {
            if (f.kind !== FrameKind.Data) {
              const got = out[i++]!
              merged.push({
                channel: got.channel,
                kind: got.kind,
                hex: Buffer.from(got.payload).toString("hex")
              })
              continue
            }
            const parts: Array<Uint8Array> = []
            let n = 0
            while (n < f.payload.length) {
              const got = out[i++]!
              expect(got.kind).toBe(FrameKind.Data)
              expect(got.channel).toBe(f.channel)
              parts.push(got.payload)
              n += got.payload.length
            }
            merged.push({ channel: f.channel, kind: f.kind, hex: Buffer.from(concat(parts)).toString("hex") })
          }
          expect(i).toBe(out.length)
          expect(merged).toEqual(
            expected.map((f) => ({
              channel: f.channel,
              kind: f.kind,
              hex: Buffer.from(f.payload).toString("hex")
            }))
          )
        }
      ),
      { numRuns: 300 }
    )
  })

  it("random bytes only ever raise FrameError, and the decoder holds at most one frame", () => {
    fc.assert(
      fc.property(fc.array(fc.uint8Array({ maxLength: 64 }), { maxLength: 20 }), (chunks) => {
        const decoder = new FrameDecoder()
        try {
          for (const c of chunks) {
            decoder.push(c)
            expect(decoder.buffered).toBeLessThanOrEqual(FRAME_HEADER_BYTES + MAX_FRAME_PAYLOAD)
          }
          decoder.finish()
        } catch (e) {
          expect(e).toBeInstanceOf(FrameError)
        }
      }),
      { numRuns: 500 }
    )
  })

  it("refuses a 4 GiB frame from its header, before buffering anything", () => {
    const decoder = new FrameDecoder()
    const error = errorOf(() => decoder.push(header(0xffffffff, 2, FrameKind.Data)))
    expect(error.reason).toMatch(/exceeds 1048576/)
    expect(decoder.buffered).toBe(0)
    // poisoned: later input gets the same error
    expect(errorOf(() => decoder.push(new Uint8Array(1)))).toBe(error)
  })

  it("accepts exactly MAX_FRAME_PAYLOAD and refuses one byte more", () => {
    const ok = new FrameDecoder().push(
      encodeFrame({ channel: 3, kind: FrameKind.Data, payload: new Uint8Array(MAX_FRAME_PAYLOAD) })
    )
    expect(ok[0]?.payload.length).toBe(MAX_FRAME_PAYLOAD)
    expect(errorOf(() => new FrameDecoder().push(header(MAX_FRAME_PAYLOAD + 1, 3, 1))).reason).toMatch(
      /exceeds/
    )
    expect(() =>
      encodeFrame({ channel: 3, kind: FrameKind.Data, payload: new Uint8Array(MAX_FRAME_PAYLOAD + 1) })
    ).toThrow(FrameError)
  })

  it("reports a truncated frame when the stream ends mid-header or mid-payload", () => {
    const d1 = new FrameDecoder()
    d1.push(new Uint8Array([0, 0, 0]))
    expect(errorOf(() => d1.finish()).reason).toMatch(/truncated frame.*3 of 9/)
    const d2 = new FrameDecoder()
    d2.push(encodeFrame({ channel: 2, kind: FrameKind.Data, payload: new Uint8Array(10) }).subarray(0, 12))
    expect(errorOf(() => d2.finish()).reason).toMatch(/truncated frame.*12 of 19/)
  })

  it("rejects kinds on the wrong channel, unknown kinds and malformed CREDIT/EOF", () => {
    const cases: Array<[Uint8Array, RegExp]> = [
      [header(2, 5, FrameKind.Control), /CONTROL frame on data channel 5/],
      [header(1, 0, FrameKind.Data), /DATA frame on the control channel/],
      [header(4, 0, FrameKind.Credit), /CREDIT frame on the control channel/],
      [header(0, 0, FrameKind.Eof), /EOF frame on the control channel/],
      [header(3, 2, FrameKind.Credit), /CREDIT frame with a 3-byte payload/],
      [header(1, 2, FrameKind.Eof), /EOF frame with a 1-byte payload/],
      [header(0, 2, 4), /unknown frame kind 4/],
      [header(0, 2, 255), /unknown frame kind 255/]
    ]
    for (const [bytes, reason] of cases) {
      expect(errorOf(() => new FrameDecoder().push(bytes)).reason).toMatch(reason)
      // split byte by byte too: same verdict on the slow path
      const d = new FrameDecoder()
      expect(errorOf(() => [...bytes].forEach((b) => d.push(new Uint8Array([b])))).reason).toMatch(reason)
    }
  })

  it("refuses to encode frames v4 does not allow", () => {
    expect(() => encodeFrame({ channel: 1, kind: FrameKind.Control, payload: new Uint8Array(0) })).toThrow(
      FrameError
    )
    expect(() => encodeFrame({ channel: 0, kind: FrameKind.Data, payload: new Uint8Array(0) })).toThrow(
      FrameError
    )
    expect(() => encodeFrame({ channel: 2 ** 32, kind: FrameKind.Data, payload: new Uint8Array(0) })).toThrow(
      FrameError
    )
    expect(() => encodeFrame({ channel: -1, kind: FrameKind.Data, payload: new Uint8Array(0) })).toThrow(
      FrameError
    )
    expect(() => encodeCredit(-1)).toThrow(FrameError)
  })
})
