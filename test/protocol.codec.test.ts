/**
 * The frame codec's paths that the Mux takes on its hot path: a frame written as header +
 * payload (one writev), CREDIT frames, the decoder's fast path (whole headers inside a chunk)
 * against its slow path (headers and payloads split across reads).
 */
import { describe, expect, it } from "@effect/vitest"
import * as fc from "fast-check"
import type { Frame } from "../src/protocol/Frame.js"
import {
  decodeCredit,
  encodeCredit,
  encodeCreditFrame,
  encodeFrame,
  encodeFrameHeader,
  FRAME_HEADER_BYTES,
  FrameDecoder,
  FrameError,
  FrameKind,
  MAX_FRAME_PAYLOAD
} from "../src/protocol/Frame.js"

const hex = (bytes: Uint8Array) => Buffer.from(bytes).toString("hex")
const concat = (parts: ReadonlyArray<Uint8Array>) => new Uint8Array(Buffer.concat(parts))
const shown = (frames: ReadonlyArray<Frame>) =>
  frames.map((f) => ({ channel: f.channel, kind: f.kind, payload: hex(f.payload) }))

/** one frame of each kind, on channel ids whose bytes are all different (byte order shows) */
const sample: ReadonlyArray<Frame> = [
  { channel: 0, kind: FrameKind.Control, payload: Buffer.from('{"type":"ready"}') },
  { channel: 0x01020304, kind: FrameKind.Data, payload: Buffer.from("hello, world") },
  { channel: 0xfffffffe, kind: FrameKind.Credit, payload: encodeCredit(0x0a0b0c0d) },
  { channel: 7, kind: FrameKind.Eof, payload: new Uint8Array(0) },
  { channel: 2, kind: FrameKind.Data, payload: new Uint8Array(0) },
  { channel: 2, kind: FrameKind.Data, payload: Buffer.alloc(300, 0xab) }
]
const sampleBytes = concat(sample.map((f) => encodeFrame(f)))

describe("frame encoders", () => {
  it("encodeFrameHeader + payload is byte for byte encodeFrame", () => {
    fc.assert(
      fc.property(
        fc.integer({ min: 1, max: 0xffffffff }),
        fc.uint8Array({ maxLength: 2000 }),
        (channel, payload) => {
          const whole = encodeFrame({ channel, kind: FrameKind.Data, payload })
          const header = encodeFrameHeader(channel, FrameKind.Data, payload.length)
          expect(header.length).toBe(FRAME_HEADER_BYTES)
          expect(hex(concat([header, payload]))).toBe(hex(whole))
        }
      )
    )
    expect(hex(encodeFrameHeader(0x01020304, FrameKind.Data, MAX_FRAME_PAYLOAD))).toBe(
      "00100000" + "01020304" + "01"
    )
    expect(hex(encodeFrameHeader(0, FrameKind.Control, 0x0a0b0c))).toBe("000a0b0c" + "00000000" + "00")
  })

  it("encodeFrameHeader refuses what encodeFrame refuses", () => {
    const refused: Array<[number, FrameKind, number]> = [
      [2, FrameKind.Data, MAX_FRAME_PAYLOAD + 1],
      [0, FrameKind.Data, 1],
      [3, FrameKind.Control, 1],
      [2, FrameKind.Credit, 3],
      [2, FrameKind.Eof, 1],
      [2 ** 32, FrameKind.Data, 0],
      [-1, FrameKind.Data, 0],
      [1.5, FrameKind.Data, 0]
    ]
    for (const [channel, kind, length] of refused) {
      expect(() => encodeFrameHeader(channel, kind, length)).toThrow(FrameError)
      expect(() => encodeFrame({ channel, kind, payload: new Uint8Array(length) })).toThrow(FrameError)
    }
  })

  it("encodeCreditFrame is the CREDIT frame of encodeFrame + encodeCredit", () => {
    fc.assert(
      fc.property(
        fc.integer({ min: 1, max: 0xffffffff }),
        fc.integer({ min: 0, max: 0xffffffff }),
        (ch, n) => {
          const frame = encodeCreditFrame(ch, n)
          expect(hex(frame)).toBe(
            hex(encodeFrame({ channel: ch, kind: FrameKind.Credit, payload: encodeCredit(n) }))
          )
          const [decoded] = new FrameDecoder().push(frame)
          expect(decoded?.kind).toBe(FrameKind.Credit)
          expect(decodeCredit(decoded!.payload)).toBe(n)
        }
      )
    )
    expect(() => encodeCreditFrame(0, 1)).toThrow(FrameError)
    expect(() => encodeCreditFrame(2, 2 ** 32)).toThrow(FrameError)
  })
})

describe("frame decoder paths", () => {
  for (const streamData of [false, true]) {
    /** streamData hands a DATA frame out in pieces: glue them back into the frames expected */
    const regroup = (pieces: ReadonlyArray<Frame>, expected: ReadonlyArray<Frame>): Array<Frame> => {
      const out: Array<Frame> = []
      let i = 0
      for (const want of expected) {
        const first = pieces[i++]
        if (first === undefined) break
        let payload = first.payload
        while (first.kind === FrameKind.Data && payload.length < want.payload.length && i < pieces.length) {
          const next = pieces[i++]!
          expect(next.kind).toBe(FrameKind.Data)
          expect(next.channel).toBe(first.channel)
          expect(next.payload.length).toBeGreaterThan(0)
          payload = concat([payload, next.payload])
        }
        out.push({ ...first, payload })
      }
      expect(i).toBe(pieces.length)
      return out
    }
    const label = streamData ? "streamData: " : ""

    it(`${label}a stream cut in two at every byte offset decodes to the same frames`, () => {
      for (let cut = 0; cut <= sampleBytes.length; cut++) {
        const decoder = new FrameDecoder({ streamData })
        const frames = [
          ...decoder.push(sampleBytes.subarray(0, cut)),
          ...decoder.push(sampleBytes.subarray(cut))
        ]
        decoder.finish()
        expect(shown(regroup(frames, sample)), `cut at ${cut}`).toEqual(shown(sample))
        expect(decoder.buffered).toBe(0)
      }
    })

    it(`${label}one read holding many frames, and one byte per read, decode alike`, () => {
      const many = concat(Array.from({ length: 500 }, () => sampleBytes))
      const decoder = new FrameDecoder({ streamData })
      const frames = decoder.push(many)
      decoder.finish()
      expect(frames.length).toBe(500 * sample.length)
      expect(shown(frames)).toEqual(shown(Array.from({ length: 500 }, () => sample).flat()))
      const slow = new FrameDecoder({ streamData })
      const pieces: Array<Frame> = []
      for (let i = 0; i < sampleBytes.length; i++) pieces.push(...slow.push(sampleBytes.subarray(i, i + 1)))
      slow.finish()
      expect(shown(regroup(pieces, sample))).toEqual(shown(sample))
    })
  }

  it("a header split across reads is checked as strictly as a whole one", () => {
    const bad = encodeFrameHeader(2, FrameKind.Data, 1)
    bad[0] = 0xff // a 4 GiB length
    for (let cut = 1; cut < FRAME_HEADER_BYTES; cut++) {
      const decoder = new FrameDecoder({ streamData: true })
      expect(decoder.push(bad.subarray(0, cut))).toEqual([])
      expect(() => decoder.push(bad.subarray(cut))).toThrow(/exceeds 1048576/)
      expect(decoder.buffered).toBe(0)
    }
  })
})
