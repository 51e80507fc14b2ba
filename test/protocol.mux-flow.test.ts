/**
 * The Mux's bulk path: credit granted in quarter-window batches (never stalling a sender), the
 * stream's own high-water mark (writers wait for 'drain' only when the peer stops reading) and
 * the channel reader (a plain async iterator).
 */
import { describe, expect, it } from "@effect/vitest"
import * as fc from "fast-check"
import {
  decodeCredit,
  encodeFrame,
  FrameDecoder,
  FrameKind,
  MAX_FRAME_PAYLOAD
} from "../src/protocol/Frame.js"
import { Mux, MuxError } from "../src/protocol/Mux.js"
import { unixSocketPairs } from "./support/socketPair.js"

const socketPair = unixSocketPairs("abox-mux-flow-")

const tick = (ms = 20) => new Promise((r) => setTimeout(r, ms))
const data = (channel: number, payload: Uint8Array) => encodeFrame({ channel, kind: FrameKind.Data, payload })
const pattern = (n: number, seed = 0) => {
  const b = Buffer.alloc(n)
  for (let i = 0; i < n; i++) b[i] = (i * 31 + seed + (i >> 11)) & 0xff
  return b
}

describe("Mux flow control", () => {
  it("grants credit in batches of at least a quarter window, however small the reads", async () => {
    const [a, raw] = await socketPair()
    const window = 64 * 1024
    const mux = new Mux(a, { initialWindow: window })
    const errors: Array<MuxError> = []
    mux.onError((e) => errors.push(e))
    const ch = mux.channel(2)
    const grants: Array<number> = []
    const decoder = new FrameDecoder()
    raw.on("data", (c: Buffer) => {
      for (const f of decoder.push(c)) if (f.kind === FrameKind.Credit) grants.push(decodeCredit(f.payload))
    })
    // the peer sends its window in 1,000-byte frames, one write each, while our reader keeps up
    let read = 0
    const reading = (async () => {
      for await (const c of ch.readable) read += c.length
    })()
    let sent = 0
    for (let round = 0; round < 4; round++) {
      // a window's worth, then wait for it to be granted back before the next (as a sender must)
      const granted = grants.reduce((n, g) => n + g, 0)
      while (sent - granted < window && sent < 4 * window) {
        const n = Math.min(1000, window - (sent - granted))
        raw.write(data(2, pattern(n, sent)))
        sent += n
        if (sent % 8000 === 0) await tick(1)
      }
      while (sent - grants.reduce((n, g) => n + g, 0) > (3 * window) / 4) await tick(5)
    }
    while (read < sent) await tick(5)
    await tick()
    raw.write(encodeFrame({ channel: 2, kind: FrameKind.Eof, payload: new Uint8Array(0) }))
    await reading
    expect(errors).toEqual([])
    expect(read).toBe(sent)
    expect(grants.length).toBeGreaterThan(0)
    for (const g of grants) expect(g).toBeGreaterThanOrEqual(window / 4)
    // everything but the last, partial quarter came back
    expect(sent - grants.reduce((n, g) => n + g, 0)).toBeLessThan(window / 4)
    mux.destroy()
    raw.destroy()
  })

  it("batched credit never stalls a transfer: any window, write sizes and reader pace", async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.integer({ min: 100, max: 20_000 }),
        fc.array(fc.integer({ min: 0, max: 30_000 }), { minLength: 1, maxLength: 8 }),
        fc.boolean(),
        async (window, writes, slowReader) => {
          const [a, b] = await socketPair()
          const host = new Mux(a, { initialWindow: window })
          const guest = new Mux(b, { initialWindow: window })
          const errors: Array<MuxError> = []
          host.onError((e) => errors.push(e))
          guest.onError((e) => errors.push(e))
          const out = host.channel(2)
          const reading = (async () => {
            const parts: Array<Buffer> = []
            for await (const c of guest.channel(2).readable) {
              parts.push(Buffer.from(c))
              if (slowReader) await new Promise((r) => setImmediate(r))
            }
            return Buffer.concat(parts)
          })()
          const all = writes.map((n, i) => pattern(n, i))
          for (const w of all) if (!out.tryWrite(w)) await out.write(w)
          await out.end()
          const got = await reading
          expect(errors).toEqual([])
          expect(got.equals(Buffer.concat(all))).toBe(true)
          host.destroy()
          guest.destroy()
        }
      ),
      { numRuns: 25 }
    )
  })

  it("a peer that stops reading: what the stream holds unsent stays bounded, and writes wait for it", async () => {
    const [a, raw] = await socketPair()
    raw.pause()
    // credit is no bound here (the peer's window is 64 MiB): only the stream's backpressure is
    const mux = new Mux(a, { sendWindow: 64 * 1024 * 1024 })
    const ch = mux.channel(2)
    let settled = false
    const writing = ch.write(new Uint8Array(32 * 1024 * 1024)).finally(() => {
      settled = true
    })
    await tick(100)
    expect(settled).toBe(false)
    expect(a.writableLength).toBeLessThanOrEqual(2 * MAX_FRAME_PAYLOAD + 64)
    expect(ch.tryWrite(new Uint8Array(1))).toBe(false)
    raw.destroy()
    await expect(writing).rejects.toBeInstanceOf(MuxError)
  })

  it("frames above Node's 16 KiB mark do not wait for 'drain' while the kernel takes them", async () => {
    const [a, b] = await socketPair()
    const host = new Mux(a)
    const guest = new Mux(b)
    const ch = host.channel(2)
    const reading = (async () => {
      let n = 0
      for await (const c of guest.channel(2).readable) n += c.length
      return n
    })()
    // an idle socket takes 2 × 40 KB at once: both go out in the same tick, no promise needed
    expect(ch.tryWrite(new Uint8Array(40_000))).toBe(true)
    expect(a.writableLength).toBe(0)
    expect(ch.tryWrite(new Uint8Array(40_000))).toBe(true)
    await ch.end()
    expect(await reading).toBe(80_000)
    host.destroy()
    guest.destroy()
  })

  it("small and big writes interleaved on several channels arrive intact", async () => {
    const [a, b] = await socketPair()
    const host = new Mux(a, { sendWindow: 8 * 1024 * 1024 })
    const guest = new Mux(b, { receiveWindow: 8 * 1024 * 1024 })
    const ids = [2, 4, 6]
    const reads = ids.map(async (id) => {
      const parts: Array<Buffer> = []
      for await (const c of guest.channel(id).readable) parts.push(Buffer.from(c))
      return Buffer.concat(parts)
    })
    const sent = new Map(ids.map((id) => [id, [] as Array<Buffer>]))
    for (let i = 0; i < 60; i++) {
      const id = ids[i % ids.length]!
      const chunk = pattern(i % 2 === 0 ? 100 : 70_000, i)
      sent.get(id)!.push(chunk)
      await host.channel(id).write(chunk)
    }
    await Promise.all(ids.map((id) => host.channel(id).end()))
    const got = await Promise.all(reads)
    ids.forEach((id, i) => expect(got[i]!.equals(Buffer.concat(sent.get(id)!))).toBe(true))
    host.destroy()
    guest.destroy()
  })
})

describe("Mux channel reader", () => {
  it("concurrent next() calls are answered in order; a second reader is refused; return() ends it", async () => {
    const [a, raw] = await socketPair()
    const mux = new Mux(a)
    const ch = mux.channel(2)
    const it = ch.readable[Symbol.asyncIterator]()
    const first = it.next()
    const second = it.next()
    raw.write(data(2, Buffer.from("one")))
    await tick()
    raw.write(data(2, Buffer.from("two")))
    expect(Buffer.from((await first).value as Uint8Array).toString()).toBe("one")
    expect(Buffer.from((await second).value as Uint8Array).toString()).toBe("two")
    await expect(ch.readable[Symbol.asyncIterator]().next()).rejects.toThrow(/already being read/)
    expect(await it.return!()).toEqual({ done: true, value: undefined })
    expect(await it.next()).toEqual({ done: true, value: undefined })
    mux.destroy()
    raw.destroy()
  })

  it("a reader waiting when the channel is destroyed fails, and stays finished", async () => {
    const [a, raw] = await socketPair()
    const mux = new Mux(a)
    const ch = mux.channel(2)
    const it = ch.readable[Symbol.asyncIterator]()
    const pending = it.next()
    ch.destroy("gone")
    await expect(pending).rejects.toThrow(/gone/)
    expect(await it.next()).toEqual({ done: true, value: undefined })
    mux.destroy()
    raw.destroy()
  })

  it("bytes buffered before EOF are all read, then the reader ends", async () => {
    const [a, raw] = await socketPair()
    const mux = new Mux(a)
    const ch = mux.channel(2)
    raw.write(
      Buffer.concat([
        data(2, Buffer.from("a")),
        data(2, Buffer.from("b")),
        encodeFrame({ channel: 2, kind: FrameKind.Eof, payload: new Uint8Array(0) })
      ])
    )
    await tick()
    const parts: Array<string> = []
    for await (const c of ch.readable) parts.push(Buffer.from(c).toString())
    expect(parts.join("")).toBe("ab")
    mux.destroy()
    raw.destroy()
  })
})
