// Raw node:http, no Effect: this client runs inside the abox-vmm helper (a small plain-node
// process on every VM's start-up path) and, wrapped in Effect, in src/vmm/vfkit.ts.
import * as http from "node:http"

/** one HTTP/1.1 request to vfkit's RESTful API over its unix socket */
export interface VfkitRestRequest {
  readonly socket: string
  readonly method: "GET" | "POST"
  readonly route: string
  readonly body?: string | undefined
  /** aborts the request (and destroys its socket) */
  readonly signal?: AbortSignal | undefined
}

/** the status and (at most 64 KiB of) the body; rejects with the socket's or the request's error */
export const vfkitRequest = (
  request: VfkitRestRequest
): Promise<{ readonly status: number; readonly body: string }> =>
  new Promise((resolve, reject) => {
    const { body } = request
    const req = http.request(
      {
        socketPath: request.socket,
        method: request.method,
        path: request.route,
        headers: {
          host: "localhost",
          ...(body === undefined
            ? {}
            : { "content-type": "application/json", "content-length": Buffer.byteLength(body) })
        },
        ...(request.signal === undefined ? {} : { signal: request.signal })
      },
      (res) => {
        let text = ""
        res.setEncoding("utf8")
        res.on("data", (chunk: string) => {
          if (text.length < 64 * 1024) text += chunk
        })
        res.on("end", () => resolve({ status: res.statusCode ?? 0, body: text }))
        res.on("error", reject)
      }
    )
    req.on("error", reject)
    req.end(body)
  })
