import { describe, expect, it } from "@effect/vitest"
import * as fc from "fast-check"
import {
  decodeCredit,
  encodeCredit,
  encodeFrame,
  FrameDecoder,
  FrameKind,
  MAX_FRAME_PAYLOAD
} from "../src/protocol/Frame.js"
import type { ControlMessage } from "../src/protocol/Messages.js"
import { GUEST_RECEIVE_WINDOW, INITIAL_WINDOW, Mux, MuxError } from "../src/protocol/Mux.js"
import { unixSocketPairs } from "./support/socketPair.js"

/** two ends of a real unix socket */
const socketPair = unixSocketPairs("abox-mux-")

const nextError = (mux: Mux): Promise<MuxError> => new Promise((resolve) => mux.onError(resolve))
const closed = (mux: Mux): Promise<void> => new Promise((resolve) => mux.onClose(resolve))
const collect = async (iterable: AsyncIterable<Uint8Array>): Promise<Buffer> => {
  const parts: Array<Buffer> = []
  for await (const c of iterable) parts.push(Buffer.from(c))
  return Buffer.concat(parts)
}
const control = (message: unknown): Uint8Array =>
  encodeFrame({ channel: 0, kind: FrameKind.Control, payload: Buffer.from(JSON.stringify(message)) })

describe("Mux", () => {
  it("carries Schema-validated control messages both ways, in order", async () => {
    const [a, b] = await socketPair()
    const host = new Mux(a)
    const guest = new Mux(b)
    const got: Array<ControlMessage> = []
    const done = new Promise<void>((resolve) =>
      host.onControl((m) => {
        got.push(m)
        if (m.type === "ready") resolve()
      })
    )
    await guest.sendControl({ type: "hello", protocol: 4, arch: "x86_64", build: "t", contextTurns: 2 })
    await guest.sendControl({ type: "ready" })
    await done
    expect(got).toEqual([
      { type: "hello", protocol: 4, arch: "x86_64", build: "t", contextTurns: 2 },
      { type: "ready" }
    ])
    const c = closed(host)
    guest.close()
    await c
    expect(host.isClosed).toBe(true)
  })

  it("delivers messages that arrived before a handler was registered", async () => {
    const [a, b] = await socketPair()
    const guest = new Mux(b)
    const host = new Mux(a)
    await guest.sendControl({ type: "ready" })
    await new Promise((r) => setTimeout(r, 20))
    const first = await new Promise<ControlMessage>((resolve) => host.onControl(resolve))
    expect(first).toEqual({ type: "ready" })
    host.destroy()
  })

  it("streams a channel with flow control and EOF (small window, slow reader)", async () => {
    const [a, b] = await socketPair()
    const window = 4096
    const host = new Mux(a, { initialWindow: window })
    const guest = new Mux(b, { initialWindow: window })
    const data = Buffer.alloc(3 * 1024 * 1024 + 17)
    for (let i = 0; i < data.length; i++) data[i] = (i * 31 + (i >> 9)) & 0xff
    const received = new Promise<Buffer>((resolve) => {
      guest.onControl(async (m) => {
        if (m.type === "transfer_begin") resolve(collect(guest.channel(m.channel).readable))
      })
    })
    await host.sendControl({ type: "transfer_begin", channel: 2, format: "tar", target: "/work/repo" })
    const ch = host.channel(2)
    for (let o = 0; o < data.length; o += 100_000) await ch.write(data.subarray(o, o + 100_000))
    await ch.end()
    const got = await received
    expect(got.length).toBe(data.length)
    expect(got.equals(data)).toBe(true)
    host.destroy()
    guest.destroy()
  })

  it("tryWrite writes within credit and refuses (writing nothing) beyond it or behind a queued write", async () => {
    const [a, b] = await socketPair()
    const host = new Mux(a, { initialWindow: 1000 })
    const guest = new Mux(b, { initialWindow: 1000 })
    const ch = host.channel(2)
    const reading = collect(guest.channel(2).readable)
    expect(ch.tryWrite(Buffer.alloc(600, 1))).toBe(true)
    expect(ch.tryWrite(Buffer.alloc(600, 2))).toBe(false) // 400 credit left
    const queued = ch.write(Buffer.alloc(600, 2)) // waits for credit
    expect(ch.tryWrite(Buffer.alloc(10, 3))).toBe(false) // a queued write goes first
    await queued
    expect(ch.tryWrite(Buffer.alloc(10, 3))).toBe(true)
    await ch.end()
    expect(ch.tryWrite(Buffer.alloc(1))).toBe(false)
    const got = await reading
    expect(got).toEqual(Buffer.concat([Buffer.alloc(600, 1), Buffer.alloc(600, 2), Buffer.alloc(10, 3)]))
    host.destroy()
    guest.destroy()
  })

  it("hello.window: the host's credit is the guest's advertised receive window; the host's own stays 256 KiB", async () => {
    const [a, b] = await socketPair()
    const host = new Mux(a)
    const guest = new Mux(b, { receiveWindow: GUEST_RECEIVE_WINDOW })
    expect(guest.receiveWindow).toBe(GUEST_RECEIVE_WINDOW)
    expect(host.receiveWindow).toBe(INITIAL_WINDOW)
    const helloSeen = new Promise<void>((resolve) =>
      host.onControl((m) => {
        if (m.type === "hello") resolve()
      })
    )
    await guest.sendControl({
      type: "hello",
      protocol: 4,
      arch: "x86_64",
      build: "t",
      window: GUEST_RECEIVE_WINDOW
    })
    await helloSeen
    const errors: Array<MuxError> = []
    host.onError((e) => errors.push(e))
    guest.onError((e) => errors.push(e))
    // nobody reads yet: the whole advertised window goes out without any CREDIT, one byte more waits
    const ch = host.channel(2)
    const guestEnd = guest.channel(2)
    expect(ch.tryWrite(Buffer.alloc(MAX_FRAME_PAYLOAD, 1))).toBe(true)
    await ch.write(Buffer.alloc(GUEST_RECEIVE_WINDOW - MAX_FRAME_PAYLOAD, 2))
    expect(ch.tryWrite(Buffer.alloc(1, 3))).toBe(false)
    const last = ch.write(Buffer.alloc(1, 3)).then(() => ch.end())
    const got = await collect(guestEnd.readable)
    await last
    expect(got.length).toBe(GUEST_RECEIVE_WINDOW + 1)
    // the other direction keeps v4's default: the guest may not send more than 256 KiB ahead
    const back = guest.channel(3)
    host.channel(3)
    expect(back.tryWrite(Buffer.alloc(INITIAL_WINDOW, 4))).toBe(true)
    expect(back.tryWrite(Buffer.alloc(1, 5))).toBe(false)
    expect(errors).toEqual([])
    host.destroy()
    guest.destroy()
  })

  it("hello.window below 256 KiB is refused as an invalid control message", async () => {
    const [a, b] = await socketPair()
    const host = new Mux(a)
    const error = nextError(host)
    b.write(control({ type: "hello", protocol: 4, arch: "x86_64", build: "t", window: 4096 }))
    expect((await error).reason).toMatch(/invalid control message/)
    b.destroy()
  })

  it("flow-control invariant: a writer never has more than `window` bytes unacknowledged", async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.integer({ min: 512, max: 8000 }),
        fc.array(fc.integer({ min: 0, max: 20000 }), { minLength: 1, maxLength: 8 }),
        fc.array(fc.integer({ min: 1, max: 7000 }), { minLength: 1, maxLength: 8 }),
        async (window, writes, grants) => {
          const [a, raw] = await socketPair()
          const mux = new Mux(a, { initialWindow: window })
          const ch = mux.channel(2)
          const total = writes.reduce((n, w) => n + w, 0)
          const decoder = new FrameDecoder()
          let inFlight = 0
          let maxInFlight = 0
          let received = 0
          let g = 0
          const finished = new Promise<void>((resolve, reject) => {
            raw.on("data", (c: Buffer) => {
              for (const f of decoder.push(c)) {
                if (f.kind === FrameKind.Eof) return resolve()
                if (f.kind !== FrameKind.Data) return reject(new Error(`unexpected kind ${f.kind}`))
                inFlight += f.payload.length
                received += f.payload.length
                maxInFlight = Math.max(maxInFlight, inFlight)
                // grant back a random amount of what is outstanding (the peer's consumer pace)
                const grant = Math.min(inFlight, grants[g++ % grants.length]!)
                if (grant > 0 && inFlight >= Math.min(window, grants[0]!)) {
                  inFlight -= grant
                  raw.write(encodeFrame({ channel: 2, kind: FrameKind.Credit, payload: encodeCredit(grant) }))
                } else if (inFlight === window) {
                  inFlight -= grant
                  raw.write(encodeFrame({ channel: 2, kind: FrameKind.Credit, payload: encodeCredit(grant) }))
                }
              }
            })
          })
          for (const w of writes) await ch.write(new Uint8Array(w))
          await ch.end()
          await finished
          expect(received).toBe(total)
          expect(maxInFlight).toBeLessThanOrEqual(window)
          mux.destroy()
          raw.destroy()
        }
      ),
      { numRuns: 25 }
    )
  })

  const violation = async (
    bytes: ReadonlyArray<Uint8Array>,
    setup?: (mux: Mux) => void,
    endAfter = false
  ) => {
    const [a, raw] = await socketPair()
    const mux = new Mux(a, { initialWindow: 1024 })
    setup?.(mux)
    const error = nextError(mux)
    const c = closed(mux)
    for (const b of bytes) raw.write(b)
    if (endAfter) raw.end()
    const e = await error
    await c
    raw.destroy()
    expect(e).toBeInstanceOf(MuxError)
    return e.reason
  }

  it("peer exceeding its credit is a protocol error", async () => {
    const reason = await violation(
      [encodeFrame({ channel: 2, kind: FrameKind.Data, payload: new Uint8Array(1025) })],
      (m) => {
        m.channel(2)
      }
    )
    expect(reason).toMatch(/exceeded its credit on channel 2/)
  })

  it("DATA on an unopened channel, or after EOF, is a protocol error", async () => {
    expect(
      await violation([encodeFrame({ channel: 4, kind: FrameKind.Data, payload: new Uint8Array(1) })])
    ).toMatch(/DATA on unopened channel 4/)
    expect(
      await violation(
        [
          encodeFrame({ channel: 2, kind: FrameKind.Eof, payload: new Uint8Array(0) }),
          encodeFrame({ channel: 2, kind: FrameKind.Data, payload: new Uint8Array(1) })
        ],
        (m) => void m.channel(2)
      )
    ).toMatch(/DATA on channel 2 after its EOF/)
  })

  it("CONTROL on a data channel, a 4 GiB frame, invalid JSON, an unknown type, a truncated frame", async () => {
    const h = Buffer.alloc(9)
    h.writeUInt32BE(2, 0)
    h.writeUInt32BE(3, 4)
    h.writeUInt8(0, 8)
    expect(await violation([h, Buffer.from("{}")])).toMatch(/CONTROL frame on data channel 3/)
    const big = Buffer.alloc(9)
    big.writeUInt32BE(0xffffffff, 0)
    big.writeUInt32BE(2, 4)
    big.writeUInt8(1, 8)
    expect(await violation([big])).toMatch(/exceeds 1048576/)
    expect(
      await violation([encodeFrame({ channel: 0, kind: 0, payload: Buffer.from("{not json") })])
    ).toMatch(/invalid control message/)
    expect(await violation([control({ type: "launch_missiles" })])).toMatch(/invalid control message/)
    expect(await violation([control({ type: "ready" }).subarray(0, 12)], undefined, true)).toMatch(
      /truncated frame/
    )
    expect(
      await violation([encodeFrame({ channel: 0, kind: 0, payload: Buffer.from([0xff, 0xfe]) })])
    ).toMatch(/UTF-8/)
  })

  it("tunnel_open on an even (host) id, on a live or used id, or past the channel bound is a protocol error", async () => {
    const open = (channel: number) => control({ type: "tunnel_open", channel, host: "h.test", port: 443 })
    expect(await violation([open(2)])).toMatch(/tunnel_open names channel 2: tunnels use odd ids/)
    expect(await violation([open(1), open(1)])).toMatch(/channel 1, a channel that is open/)
    expect(await violation([open(1), control({ type: "tunnel_close", channel: 1 }), open(1)])).toMatch(
      /channel 1, an id already used/
    )
    expect(await violation([open(5), open(3)])).toMatch(/channel 3, an id already used/)
    expect(
      await violation([control({ type: "transfer_begin", channel: 3, format: "tar", target: "/w" })])
    ).toMatch(/the host opens even ids/)
    const exportOn = (channel: number) =>
      control({ type: "export_begin", channel, tree: "repo", paths: [], exclude: [] })
    expect(await violation([exportOn(3)])).toMatch(/export_begin names channel 3: the host opens even ids/)
    expect(await violation([exportOn(4), exportOn(2)])).toMatch(/channel 2, an id already used/)
    // a bound on live channels: the 5th open of a mux that holds 4 closes the connection
    const [a, raw] = await socketPair()
    const mux = new Mux(a, { maxChannels: 4 })
    mux.onControl(() => undefined)
    const error = nextError(mux)
    for (const id of [1, 3, 5, 7, 9]) raw.write(open(id))
    expect((await error).reason).toMatch(/more than 4 channels at once/)
    raw.destroy()
  })

  it("finished channels leave nothing behind: 5,000 tunnels opened and closed, late frames dropped", async () => {
    const [a, raw] = await socketPair()
    const mux = new Mux(a)
    const errors: Array<MuxError> = []
    mux.onError((e) => errors.push(e))
    let seen = 0
    mux.onControl(() => {
      seen++
    })
    const frames: Array<Uint8Array> = []
    for (let id = 1; id < 10_000; id += 2) {
      frames.push(control({ type: "tunnel_open", channel: id, host: "h.test", port: 443 }))
      frames.push(control({ type: "tunnel_close", channel: id }))
      // in flight when it closed: dropped, not a protocol error
      frames.push(encodeFrame({ channel: id, kind: FrameKind.Data, payload: Buffer.from("late") }))
    }
    raw.write(Buffer.concat(frames))
    while (seen < 10_000 && errors.length === 0) await new Promise((r) => setTimeout(r, 10))
    expect(errors).toEqual([])
    expect(mux.liveChannels).toBe(0)
    // no collection inside the mux keeps one entry per finished channel
    for (const value of Object.values(mux)) {
      if (value instanceof Set || value instanceof Map) expect(value.size).toBeLessThan(16)
      if (Array.isArray(value)) expect(value.length).toBeLessThan(16)
    }
    mux.destroy()
    raw.destroy()
  })

  it("a peer's tunnel_close after its EOF keeps what it sent: the reader gets every byte, then the end", async () => {
    const [a, raw] = await socketPair()
    const mux = new Mux(a)
    const seen: Array<string> = []
    mux.onControl((m) => {
      seen.push(m.type)
    })
    const body = Buffer.from("the last bytes of a response ".repeat(40))
    const opened = async (id: number) => {
      raw.write(control({ type: "tunnel_open", channel: id, host: "h.test", port: 443 }))
      while (seen.filter((t) => t === "tunnel_open").length < (id + 1) / 2) await new Promise((r) => setTimeout(r, 5))
      return mux.channel(id)
    }
    const closes = () => seen.filter((t) => t === "tunnel_close").length
    const first = await opened(1)
    raw.write(
      Buffer.concat([
        encodeFrame({ channel: 1, kind: FrameKind.Data, payload: body.subarray(0, 500) }),
        encodeFrame({ channel: 1, kind: FrameKind.Data, payload: body.subarray(500) }),
        encodeFrame({ channel: 1, kind: FrameKind.Eof, payload: new Uint8Array(0) }),
        control({ type: "tunnel_close", channel: 1 })
      ])
    )
    // every frame is in before anything is read (a proxy whose client is slow)
    while (closes() < 1) await new Promise((r) => setTimeout(r, 5))
    expect((await collect(first.readable)).toString()).toBe(body.toString())
    // without its EOF, a close is a reset: what was not read is dropped
    const second = await opened(3)
    raw.write(
      Buffer.concat([
        encodeFrame({ channel: 3, kind: FrameKind.Data, payload: body }),
        control({ type: "tunnel_close", channel: 3 })
      ])
    )
    while (closes() < 2) await new Promise((r) => setTimeout(r, 5))
    await expect(collect(second.readable)).rejects.toThrow(/closed by the peer/)
    mux.destroy()
    raw.destroy()
  })

  it("credit granted beyond what was sent is a protocol error", async () => {
    expect(
      await violation(
        [encodeFrame({ channel: 2, kind: FrameKind.Credit, payload: encodeCredit(1) })],
        (m) => void m.channel(2)
      )
    ).toMatch(/more credit than was sent/)
  })

  it("random bytes from the peer never throw past the typed error", async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.array(fc.uint8Array({ minLength: 1, maxLength: 200 }), { minLength: 1, maxLength: 5 }),
        async (chunks) => {
          const [a, raw] = await socketPair()
          const mux = new Mux(a, { initialWindow: 64 })
          mux.channel(1)
          mux.channel(2)
          const errors: Array<unknown> = []
          mux.onError((e) => errors.push(e))
          mux.onControl(() => undefined)
          const c = closed(mux)
          for (const chunk of chunks) raw.write(chunk)
          raw.end()
          await c
          raw.destroy()
          for (const e of errors) expect(e).toBeInstanceOf(MuxError)
          expect(errors.length).toBeLessThanOrEqual(1)
        }
      ),
      { numRuns: 60 }
    )
  })

  it("a peer that stops reading: writes wait on credit with bounded buffers, then fail when it disconnects", async () => {
    const [a, raw] = await socketPair()
    raw.pause()
    const mux = new Mux(a)
    const ch = mux.channel(2)
    let settled = false
    const writing = ch.write(new Uint8Array(20 * 1024 * 1024)).finally(() => {
      settled = true
    })
    await new Promise((r) => setTimeout(r, 100))
    expect(settled).toBe(false)
    // at most one window (+ frame headers) was handed to the socket
    expect(a.bytesWritten).toBeLessThanOrEqual(256 * 1024 + 64)
    raw.destroy()
    await expect(writing).rejects.toBeInstanceOf(MuxError)
  })

  it("a control consumer that stops pauses the socket (bounded control queue)", async () => {
    const [a, b] = await socketPair()
    const host = new Mux(a, { maxControlQueue: 4 })
    const guest = new Mux(b)
    const release: Array<() => void> = []
    let delivered = 0
    host.onControl(() => {
      delivered++
      return new Promise<void>((r) => release.push(r))
    })
    for (let i = 0; i < 200; i++)
      void guest.sendControl({
        type: "agent_event",
        turn: 1,
        event: { kind: "stdout", data: "x".repeat(1000) }
      })
    await new Promise((r) => setTimeout(r, 100))
    expect(a.isPaused()).toBe(true)
    const held = delivered
    expect(held).toBeLessThan(200)
    while (delivered < 200) {
      release.splice(0).forEach((r) => r())
      await new Promise((r) => setTimeout(r, 5))
    }
    release.splice(0).forEach((r) => r())
    expect(delivered).toBe(200)
    host.destroy()
    guest.destroy()
  })

  it("a control queue bound holds between the frames of one chunk: 1,000 messages in one write, 4 held", async () => {
    const [a, raw] = await socketPair()
    const host = new Mux(a, { maxControlQueue: 4 })
    const release: Array<() => void> = []
    let delivered = 0
    host.onControl(() => {
      delivered++
      return new Promise<void>((r) => release.push(r))
    })
    const frames: Array<Uint8Array> = []
    for (let id = 1; id < 2000; id += 2)
      frames.push(control({ type: "tunnel_open", channel: id, host: "h.test", port: 443 }))
    raw.write(Buffer.concat(frames))
    await new Promise((r) => setTimeout(r, 100))
    expect(delivered).toBe(4)
    // opens not yet handled have opened no channel either
    expect(host.liveChannels).toBeLessThanOrEqual(4)
    while (delivered < 1000) {
      release.splice(0).forEach((r) => r())
      await new Promise((r) => setTimeout(r, 1))
    }
    expect(delivered).toBe(1000)
    host.destroy()
    raw.destroy()
  })

  it("a channel reader fails when the connection drops before EOF, but keeps a finished peer's bytes", async () => {
    const [a, raw] = await socketPair()
    const mux = new Mux(a)
    const ch = mux.channel(2)
    raw.write(encodeFrame({ channel: 2, kind: FrameKind.Data, payload: Buffer.from("abc") }))
    const reading = collect(ch.readable)
    await new Promise((r) => setTimeout(r, 20))
    raw.destroy()
    await expect(reading).rejects.toBeInstanceOf(MuxError)

    const [a2, raw2] = await socketPair()
    const mux2 = new Mux(a2)
    const ch2 = mux2.channel(2)
    raw2.write(encodeFrame({ channel: 2, kind: FrameKind.Data, payload: Buffer.from("abc") }))
    raw2.end(encodeFrame({ channel: 2, kind: FrameKind.Eof, payload: new Uint8Array(0) }))
    await closed(mux2)
    expect((await collect(ch2.readable)).toString()).toBe("abc")
    expect(decodeCredit(encodeCredit(3))).toBe(3)
  })
})
