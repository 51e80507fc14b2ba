import { describe, expect, it } from "@effect/vitest"
import { peekClientHello, readClientHello } from "../src/broker/clientHello.js"
import { clientHelloBytes, duplexPair } from "./support/brokerHarness.js"

/** the ClientHello re-framed as one handshake record per `size` bytes of handshake data */
const reframe = (hello: Buffer, size: number): Buffer => {
  const body = hello.subarray(5, 5 + hello.readUInt16BE(3))
  const records: Array<Buffer> = []
  for (let at = 0; at < body.length; at += size) {
    const part = body.subarray(at, at + size)
    const header = Buffer.from([22, 3, 1, 0, 0])
    header.writeUInt16BE(part.length, 3)
    records.push(header, part)
  }
  return Buffer.concat(records)
}

describe("the ClientHello of a pass-through tunnel", () => {
  it("finds the SNI of a real ClientHello, whole, in pieces and across records", async () => {
    const hello = await clientHelloBytes("api.example.com")
    expect(peekClientHello(hello)).toEqual({ status: "hello", serverNames: ["api.example.com"] })
    for (const cut of [1, 5, 40, hello.length - 1])
      expect(peekClientHello(hello.subarray(0, cut))).toEqual({ status: "incomplete" })
    const split = reframe(hello, 50)
    expect(peekClientHello(split)).toEqual({ status: "hello", serverNames: ["api.example.com"] })
    // early data after a whole ClientHello is fine; another record inside one is not
    expect(peekClientHello(Buffer.concat([hello, Buffer.from([23, 3, 3, 0, 1, 0])]))).toMatchObject({
      status: "hello"
    })
    const interrupted = Buffer.concat([split.subarray(0, 55), Buffer.from([23, 3, 3, 0, 1, 0])])
    expect(peekClientHello(interrupted)).toMatchObject({ status: "not-tls" })
  })

  it("no SNI, plain HTTP, garbage", async () => {
    expect(peekClientHello(await clientHelloBytes(undefined))).toEqual({ status: "hello", serverNames: [] })
    expect(peekClientHello(Buffer.from("GET / HTTP/1.1\r\n\r\n"))).toMatchObject({ status: "not-tls" })
    expect(peekClientHello(Buffer.from([22, 3, 1, 0, 0]))).toMatchObject({ status: "not-tls" })
    expect(peekClientHello(Buffer.from([22, 3, 1, 0, 4, 2, 0, 0, 0]))).toMatchObject({ status: "not-tls" })
    // a ClientHello whose declared lengths run past its end
    const hello = await clientHelloBytes("a.example")
    const broken = Buffer.from(hello)
    broken[5 + 4 + 34] = 200 // session id length
    expect(peekClientHello(broken)).toMatchObject({ status: "not-tls" })
  })

  it("readClientHello: the right name passes with the bytes read; others are refused", async () => {
    const check = async (bytes: Buffer, host: string, chunk = bytes.length) => {
      const [a, b] = duplexPair()
      const result = readClientHello(b, host, { timeoutMs: 2000 })
      for (let at = 0; at < bytes.length; at += chunk) a.write(bytes.subarray(at, at + chunk))
      const r = await result
      a.destroy()
      return r
    }
    const hello = await clientHelloBytes("Allowed.Example.")
    expect(await check(hello, "allowed.example", 7)).toEqual({ ok: true, head: hello })
    expect(await check(await clientHelloBytes("evil.example"), "allowed.example")).toEqual({
      ok: false,
      reason: "sni-mismatch"
    })
    expect(await check(await clientHelloBytes(undefined), "allowed.example")).toEqual({
      ok: false,
      reason: "sni-missing"
    })
    expect(await check(Buffer.from("GET / HTTP/1.1\r\n\r\n"), "allowed.example")).toEqual({
      ok: false,
      reason: "not-tls"
    })
    const [a, b] = duplexPair()
    const silent = readClientHello(b, "allowed.example", { timeoutMs: 50 })
    expect(await silent).toEqual({ ok: false, reason: "hello-timeout" })
    a.destroy()
  })
})
