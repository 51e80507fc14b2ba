/**
 * The model client's trust after a restore (a resume, a fork): the connector asks for its extra
 * CAs on each connection, so once the agent hears `resumed` with a new broker CA, the next model
 * connection trusts that CA and no longer the one of the boot (real TLS servers on loopback,
 * leaves from two real session CAs).
 */
import { describe, expect, it } from "@effect/vitest"
import type * as net from "node:net"
import * as tls from "node:tls"
import { makeSessionCa } from "../src/broker/ca.js"
import { tunnelConnector } from "../src/guest/model/index.js"

const serve = (leaf: { readonly certPem: string; readonly keyPem: string }) =>
  new Promise<tls.Server>((resolve) => {
    const server = tls.createServer({ cert: leaf.certPem, key: leaf.keyPem }, (socket) => socket.end())
    server.listen(0, "127.0.0.1", () => resolve(server))
  })

const portOf = (server: tls.Server) => (server.address() as net.AddressInfo).port

/** one TLS connection through the connector: "ok", or the error's code */
const connect = (connector: ReturnType<typeof tunnelConnector>, port: number) =>
  new Promise<string>((resolve) => {
    connector(
      { hostname: "localhost", host: "localhost", port: String(port), protocol: "https:", servername: "localhost" } as never,
      (error, socket) => {
        if (error !== null) return resolve((error as NodeJS.ErrnoException).code ?? error.message)
        socket?.destroy()
        resolve("ok")
      }
    )
  })

describe("the model client's CAs", () => {
  it("trusts the CA it is given now, not the one it first connected with", async () => {
    const [before, after] = await Promise.all([
      makeSessionCa({ commonName: "boot broker" }),
      makeSessionCa({ commonName: "restored broker" })
    ])
    const oldBroker = await serve(before.leaf("localhost"))
    const newBroker = await serve(after.leaf("localhost"))
    try {
      const trust = { pems: [before.certPem] as ReadonlyArray<string> }
      const connector = tunnelConnector(undefined, () => trust.pems, () => undefined)
      expect(await connect(connector, portOf(oldBroker))).toBe("ok")
      expect(await connect(connector, portOf(newBroker))).not.toBe("ok")
      // `resumed` brought the new CA
      trust.pems = [after.certPem]
      expect(await connect(connector, portOf(newBroker))).toBe("ok")
      expect(await connect(connector, portOf(oldBroker))).not.toBe("ok")
    } finally {
      oldBroker.close()
      newBroker.close()
    }
  }, 60_000)
})
