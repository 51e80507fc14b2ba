/**
 * Two ends of a real unix socket, for tests of the Mux and its adapter. Each test file makes its
 * own maker: the sockets live in a temporary directory of that file, removed after its tests.
 */
import { mkdtempSync, rmSync } from "node:fs"
import * as net from "node:net"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "@effect/vitest"

/** a maker of connected pairs `[client, accepted]`, each on a socket file of its own under a fresh directory */
export const unixSocketPairs = (prefix: string): (() => Promise<[net.Socket, net.Socket]>) => {
  const dir = mkdtempSync(join(tmpdir(), prefix))
  afterAll(() => rmSync(dir, { recursive: true, force: true }))
  let counter = 0
  return () =>
    new Promise((resolve, reject) => {
      const path = join(dir, `s${counter++}.sock`)
      const server = net.createServer((accepted) => {
        server.close()
        client.once("connect", () => resolve([client, accepted]))
        if (!client.connecting) resolve([client, accepted])
      })
      server.on("error", reject)
      let client: net.Socket
      server.listen(path, () => {
        client = net.connect(path)
      })
    })
}
