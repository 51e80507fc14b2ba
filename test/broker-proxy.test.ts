import { describe, expect, it } from "@effect/vitest"
import * as net from "node:net"
import { guestProxyEnv, startConnectProxy } from "../src/guest/connectProxy.js"
import { CREDENTIAL_PLACEHOLDER } from "../src/protocol/GuestConfig.js"
import { duplexPair } from "./support/brokerHarness.js"

/** send raw bytes to the proxy, collect everything until it closes */
const exchange = (port: number, payload: string) =>
  new Promise<string>((resolve) => {
    const socket = net.connect({ host: "127.0.0.1", port }, () => socket.write(payload))
    let text = ""
    socket.on("data", (c: Buffer) => (text += c.toString("latin1")))
    socket.on("close", () => resolve(text))
    socket.on("error", () => resolve(text))
  })

describe("guest CONNECT proxy (real sockets)", () => {
  it("answers 200 and carries bytes both ways, including bytes sent right after the CONNECT head", async () => {
    const asked: Array<string> = []
    const proxy = await startConnectProxy({
      openTunnel: (host, port) => {
        asked.push(`${host}:${port}`)
        const [guest, host_] = duplexPair()
        // an echo server standing in for the host side
        host_.on("data", (c: Buffer) => host_.write(Buffer.from(c.toString().toUpperCase())))
        host_.on("end", () => host_.end())
        return Promise.resolve({ ok: true, stream: guest })
      }
    })
    try {
      const answer = await new Promise<string>((resolve) => {
        const socket = net.connect({ host: "127.0.0.1", port: proxy.port }, () =>
          socket.write(
            "CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443\r\n\r\nearly bytes;"
          )
        )
        let text = ""
        socket.on("data", (c: Buffer) => {
          text += c.toString()
          if (text.includes("EARLY BYTES;") && !text.includes("LATE")) socket.write("late")
          if (text.includes("LATE")) socket.end()
        })
        socket.on("close", () => resolve(text))
      })
      expect(answer).toBe("HTTP/1.1 200 Connection Established\r\n\r\nEARLY BYTES;LATE")
      expect(asked).toEqual(["api.example.com:443"])
    } finally {
      await proxy.close()
    }
  })

  it("passes the host's refusal on as 403 with the reason; refuses non-CONNECT, bad targets, big or slow heads", async () => {
    const asked: Array<string> = []
    const proxy = await startConnectProxy({
      openTunnel: (host, port) => {
        asked.push(`${host}:${port}`)
        return Promise.resolve({ ok: false, reason: "host-not-allowed" })
      },
      maxHeadBytes: 1024,
      headTimeoutMs: 200
    })
    try {
      const denied = await exchange(proxy.port, "CONNECT evil.com:443 HTTP/1.1\r\n\r\n")
      // the reason in the status line too: what curl -v, GNU wget, git and Python print
      expect(denied).toMatch(/^HTTP\/1\.1 403 Forbidden \(abox: host-not-allowed\)\r\n/)
      expect(denied).toContain("X-Abox-Deny-Reason: host-not-allowed\r\n")
      const v6 = await exchange(proxy.port, "CONNECT [::1]:443 HTTP/1.1\r\n\r\n")
      expect(v6).toMatch(/^HTTP\/1\.1 403/)
      expect(asked).toEqual(["evil.com:443", "[::1]:443"]) // passed on as written: the host decides
      // plain HTTP through the proxy: a 403 with the reason (status line, header, body), never a
      // 405 a client reports obscurely
      const plain = await exchange(
        proxy.port,
        "GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n"
      )
      expect(plain).toMatch(/^HTTP\/1\.1 403 Forbidden \(abox: plain-http-not-brokered: [^\r]*\)\r\n/)
      expect(plain).toContain("X-Abox-Deny-Reason: plain-http-not-brokered")
      expect(plain).toMatch(/\r\n\r\nForbidden \(abox: plain-http-not-brokered[^\n]*\n$/)
      expect(await exchange(proxy.port, "GET / FTP/1.0\r\n\r\n")).toMatch(/^HTTP\/1\.1 400/)
      expect(await exchange(proxy.port, "CONNECT example.com HTTP/1.1\r\n\r\n")).toMatch(/^HTTP\/1\.1 400/)
      expect(await exchange(proxy.port, "CONNECT example.com:99999 HTTP/1.1\r\n\r\n")).toMatch(
        /^HTTP\/1\.1 400/
      )
      expect(
        await exchange(proxy.port, `CONNECT example.com:443 HTTP/1.1\r\nX: ${"a".repeat(2048)}\r\n\r\n`)
      ).toMatch(/^HTTP\/1\.1 431/)
      const started = Date.now()
      expect(await exchange(proxy.port, "CONNECT exam")).toMatch(/^HTTP\/1\.1 408/)
      expect(Date.now() - started).toBeLessThan(3000)
      expect(asked).toHaveLength(2)
    } finally {
      await proxy.close()
    }
  })

  it("the environment for guest processes points every client at the proxy and the CA files", () => {
    const env = guestProxyEnv({
      port: 3128,
      caBundlePath: "/etc/abox/ca-bundle.pem",
      sessionCaPath: "/etc/abox/broker-ca.pem"
    })
    for (const name of ["HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy"])
      expect(env[name]).toBe("http://127.0.0.1:3128")
    expect(env.NODE_EXTRA_CA_CERTS).toBe("/etc/abox/broker-ca.pem")
    for (const name of [
      "SSL_CERT_FILE",
      "CURL_CA_BUNDLE",
      "REQUESTS_CA_BUNDLE",
      "GIT_SSL_CAINFO",
      "PIP_CERT",
      "npm_config_cafile"
    ])
      expect(env[name]).toBe("/etc/abox/ca-bundle.pem")
    // each client's own spelling of the proxy: npm, pip, git's http.proxy
    for (const name of ["npm_config_https_proxy", "npm_config_proxy", "PIP_PROXY"])
      expect(env[name]).toBe("http://127.0.0.1:3128")
    expect([env.GIT_CONFIG_COUNT, env.GIT_CONFIG_KEY_0, env.GIT_CONFIG_VALUE_0]).toEqual([
      "1",
      "http.proxy",
      "http://127.0.0.1:3128"
    ])
    expect(env.NODE_USE_ENV_PROXY).toBe("1")
    expect(CREDENTIAL_PLACEHOLDER).toBe("abox-placeholder")
  })
})
