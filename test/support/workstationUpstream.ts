/**
 * Local stand-ins for what a workstation's clients reach, behind one HTTPS server on 127.0.0.1
 * with its own test CA (a certificate per name, picked by SNI), routed by name:
 *
 * - `files.<domain>`: `GET /hello` (curl, GNU wget, Node's fetch);
 * - `registry.<domain>`: an npm registry (packuments and tarballs, real `.tgz` files);
 * - `pypi.<domain>`: a PEP 503 simple index serving one real wheel;
 * - `git.<domain>`: smart HTTP through `git http-backend` (CGI) over a bare repository;
 * - `openai.<domain>` (or an alias): `POST /v1/chat/completions` streamed as the OpenAI API does (SSE);
 * - `anthropic.<domain>` (or an alias): `POST /v1/messages` streamed as the Anthropic API does (SSE).
 *
 * Every request is recorded (name, method, url, headers) for assertions.
 */
import { spawn } from "node:child_process"
import * as crypto from "node:crypto"
import * as fs from "node:fs"
import type * as http from "node:http"
import * as https from "node:https"
import type * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import * as tls from "node:tls"
import * as zlib from "node:zlib"
import * as tar from "tar"
import { makeSessionCa } from "../../src/broker/ca.js"

export interface SeenRequest {
  readonly name: string
  readonly method: string
  readonly url: string
  readonly headers: Readonly<Record<string, string | ReadonlyArray<string> | undefined>>
}

export interface NpmPackage {
  readonly name: string
  readonly version: string
  readonly tarball: Buffer
  readonly manifest: Readonly<Record<string, unknown>>
}

const walk = (dir: string, keep: (relative: string) => boolean, base = dir): Array<string> =>
  fs.readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const full = path.join(dir, entry.name)
    const relative = path.relative(base, full)
    if (entry.isDirectory()) return entry.name === "node_modules" ? [] : walk(full, keep, base)
    return entry.isFile() && keep(relative) ? [relative] : []
  })

/**
 * A package directory packed as npm packs it (a gzipped tar of `package/...`). `keep` selects
 * files (e.g. only the CommonJS runtime of a large SDK).
 */
export const packDirectory = async (
  dir: string,
  keep: (relative: string) => boolean = () => true
): Promise<NpmPackage> => {
  const manifest = JSON.parse(fs.readFileSync(path.join(dir, "package.json"), "utf8")) as Record<
    string,
    unknown
  >
  const files = walk(dir, (relative) => relative === "package.json" || keep(relative)).sort()
  const out = path.join(fs.mkdtempSync(path.join(os.tmpdir(), "abox-pack-")), "package.tgz")
  await tar.create({ gzip: true, cwd: dir, prefix: "package", portable: true, file: out }, files)
  const tarball = fs.readFileSync(out)
  fs.rmSync(path.dirname(out), { recursive: true, force: true })
  return { name: String(manifest.name), version: String(manifest.version), tarball, manifest }
}

/** a wheel (a zip, stored entries) with METADATA, WHEEL, RECORD and one module */
export const makeWheel = (name: string, version: string): { file: string; bytes: Buffer } => {
  const module = name.replace(/-/g, "_")
  const info = `${module}-${version}.dist-info`
  const entries: Array<[string, Buffer]> = [
    [`${module}/__init__.py`, Buffer.from(`VERSION = "${version}"\n`)],
    [`${info}/METADATA`, Buffer.from(`Metadata-Version: 2.1\nName: ${name}\nVersion: ${version}\n`)],
    [
      `${info}/WHEEL`,
      Buffer.from("Wheel-Version: 1.0\nGenerator: abox-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    ]
  ]
  const record = entries
    .map(
      ([file, data]) =>
        `${file},sha256=${crypto.createHash("sha256").update(data).digest("base64url")},${data.length}`
    )
    .join("\n")
  entries.push([`${info}/RECORD`, Buffer.from(`${record}\n${info}/RECORD,,\n`)])
  const locals: Array<Buffer> = []
  const centrals: Array<Buffer> = []
  let offset = 0
  for (const [file, data] of entries) {
    const nameBytes = Buffer.from(file)
    const crc = zlib.crc32(data)
    const local = Buffer.alloc(30)
    local.writeUInt32LE(0x04034b50, 0)
    local.writeUInt16LE(20, 4)
    local.writeUInt16LE(0x21, 12) // 1980-01-01
    local.writeUInt32LE(crc, 14)
    local.writeUInt32LE(data.length, 18)
    local.writeUInt32LE(data.length, 22)
    local.writeUInt16LE(nameBytes.length, 26)
    const central = Buffer.alloc(46)
    central.writeUInt32LE(0x02014b50, 0)
    central.writeUInt16LE(20, 4)
    central.writeUInt16LE(20, 6)
    central.writeUInt16LE(0x21, 14)
    central.writeUInt32LE(crc, 16)
    central.writeUInt32LE(data.length, 20)
    central.writeUInt32LE(data.length, 24)
    central.writeUInt16LE(nameBytes.length, 28)
    central.writeUInt32LE(offset, 42)
    locals.push(local, nameBytes, data)
    centrals.push(central, nameBytes)
    offset += local.length + nameBytes.length + data.length
  }
  const directory = Buffer.concat(centrals)
  const end = Buffer.alloc(22)
  end.writeUInt32LE(0x06054b50, 0)
  end.writeUInt16LE(entries.length, 8)
  end.writeUInt16LE(entries.length, 10)
  end.writeUInt32LE(directory.length, 12)
  end.writeUInt32LE(offset, 16)
  return { file: `${module}-${version}-py3-none-any.whl`, bytes: Buffer.concat([...locals, directory, end]) }
}

const sseOpenAi = (texts: ReadonlyArray<string>) => [
  ...texts.map(
    (text, i) =>
      `data: ${JSON.stringify({
        id: "chatcmpl-abox",
        object: "chat.completion.chunk",
        created: 0,
        model: "gpt-test",
        choices: [
          {
            index: 0,
            delta: i === 0 ? { role: "assistant", content: text } : { content: text },
            finish_reason: null
          }
        ]
      })}\n\n`
  ),
  `data: ${JSON.stringify({ id: "chatcmpl-abox", object: "chat.completion.chunk", created: 0, model: "gpt-test", choices: [{ index: 0, delta: {}, finish_reason: "stop" }] })}\n\n`,
  "data: [DONE]\n\n"
]

const sseAnthropic = (texts: ReadonlyArray<string>) => {
  const event = (type: string, data: object) =>
    `event: ${type}\ndata: ${JSON.stringify({ type, ...data })}\n\n`
  return [
    event("message_start", {
      message: {
        id: "msg_abox",
        type: "message",
        role: "assistant",
        model: "claude-test",
        content: [],
        stop_reason: null,
        stop_sequence: null,
        usage: { input_tokens: 1, output_tokens: 0 }
      }
    }),
    event("content_block_start", { index: 0, content_block: { type: "text", text: "" } }),
    ...texts.map((text) => event("content_block_delta", { index: 0, delta: { type: "text_delta", text } })),
    event("content_block_stop", { index: 0 }),
    event("message_delta", {
      delta: { stop_reason: "end_turn", stop_sequence: null },
      usage: { output_tokens: texts.length }
    }),
    event("message_stop", {})
  ]
}

/** SSE events written one by one, a little apart: the client must parse a stream, not one body */
const streamEvents = (res: http.ServerResponse, events: ReadonlyArray<string>) => {
  res.writeHead(200, { "content-type": "text/event-stream", "cache-control": "no-cache" })
  let i = 0
  const next = () => {
    if (i === events.length) return void res.end()
    res.write(events[i++])
    setTimeout(next, 20)
  }
  next()
}

export interface WorkstationUpstreamOptions {
  /** e.g. `test.local`: the server answers for files., registry., pypi., git., openai., anthropic. */
  readonly domain: string
  readonly npmPackages: ReadonlyArray<NpmPackage>
  readonly wheel: { readonly project: string; readonly file: string; readonly bytes: Buffer }
  /** the directory holding bare repositories served by git http-backend */
  readonly gitRoot: string
  /** other names the server answers for, mapped to a route (e.g. `api.openai.com` → `openai`) */
  readonly aliases?: Readonly<Record<string, string>>
}

export const startWorkstationUpstream = async (options: WorkstationUpstreamOptions) => {
  const ca = await makeSessionCa({ commonName: "abox test workstation upstream CA" })
  const contexts = new Map<string, tls.SecureContext>()
  const contextFor = (name: string) => {
    let context = contexts.get(name)
    if (context === undefined) {
      const leaf = ca.leaf(name)
      context = tls.createSecureContext({ cert: leaf.certPem, key: leaf.keyPem })
      contexts.set(name, context)
    }
    return context
  }
  const first = ca.leaf(`files.${options.domain}`)
  const seen: Array<SeenRequest> = []
  let port = 0
  const origin = (name: string) => `https://${name}.${options.domain}:${port}`
  const tarballs = new Map<string, Buffer>()
  const packuments = new Map<string, object>()
  const registerPackages = () => {
    for (const pkg of options.npmPackages) {
      const file = `${pkg.name.replace("@", "").replace("/", "-")}-${pkg.version}.tgz`
      tarballs.set(file, pkg.tarball)
      const pick = (key: string) => (pkg.manifest[key] === undefined ? {} : { [key]: pkg.manifest[key] })
      packuments.set(pkg.name, {
        name: pkg.name,
        "dist-tags": { latest: pkg.version },
        versions: {
          [pkg.version]: {
            name: pkg.name,
            version: pkg.version,
            ...pick("dependencies"),
            ...pick("peerDependencies"),
            ...pick("peerDependenciesMeta"),
            ...pick("bin"),
            ...pick("engines"),
            dist: {
              tarball: `${origin("registry")}/-/tarballs/${file}`,
              integrity: `sha512-${crypto.createHash("sha512").update(pkg.tarball).digest("base64")}`,
              shasum: crypto.createHash("sha1").update(pkg.tarball).digest("hex")
            }
          }
        }
      })
    }
  }

  const server = https.createServer(
    {
      cert: first.certPem,
      key: first.keyPem,
      SNICallback: (servername, callback) => callback(null, contextFor(servername))
    },
    (req, res) => {
      const host = String(req.headers.host ?? "").replace(/:\d+$/, "")
      const name =
        options.aliases?.[host] ??
        (host.endsWith(`.${options.domain}`) ? host.slice(0, -options.domain.length - 1) : host)
      seen.push({ name, method: req.method ?? "", url: req.url ?? "", headers: { ...req.headers } })
      const url = new URL(req.url ?? "/", "https://upstream")
      const send = (status: number, type: string, body: string | Buffer) => {
        res.writeHead(status, { "content-type": type, "content-length": String(Buffer.byteLength(body)) })
        res.end(body)
      }
      if (name === "git") return gitBackend(options.gitRoot, req, res, url)
      req.resume()
      if (name === "files" && url.pathname === "/hello") return send(200, "text/plain", "hello from files\n")
      if (name === "registry") {
        if (url.pathname.startsWith("/-/tarballs/")) {
          const tarball = tarballs.get(url.pathname.slice("/-/tarballs/".length))
          return tarball === undefined
            ? send(404, "text/plain", "no such tarball\n")
            : send(200, "application/octet-stream", tarball)
        }
        const packument = packuments.get(decodeURIComponent(url.pathname.slice(1)))
        return packument === undefined
          ? send(404, "application/json", '{"error":"not found"}')
          : send(200, "application/json", JSON.stringify(packument))
      }
      if (name === "pypi") {
        const project = options.wheel.project
        if (url.pathname === `/simple/${project}/`) {
          const sha = crypto.createHash("sha256").update(options.wheel.bytes).digest("hex")
          return send(
            200,
            "text/html",
            `<!DOCTYPE html><html><body><a href="/files/${options.wheel.file}#sha256=${sha}">${options.wheel.file}</a></body></html>\n`
          )
        }
        if (url.pathname === `/files/${options.wheel.file}`)
          return send(200, "application/octet-stream", options.wheel.bytes)
        return send(404, "text/plain", "not found\n")
      }
      if (name === "openai" && req.method === "POST" && url.pathname === "/v1/chat/completions")
        return streamEvents(res, sseOpenAi(["hello ", "from ", "openai"]))
      if (name === "anthropic" && req.method === "POST" && url.pathname === "/v1/messages")
        return streamEvents(res, sseAnthropic(["hello ", "from ", "anthropic"]))
      send(404, "text/plain", "not found\n")
    }
  )
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", () => resolve()))
  port = (server.address() as net.AddressInfo).port
  registerPackages()
  return {
    port,
    caPem: ca.certPem,
    seen,
    origin,
    tarballUrl: (pkg: NpmPackage) =>
      `${origin("registry")}/-/tarballs/${pkg.name.replace("@", "").replace("/", "-")}-${pkg.version}.tgz`,
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections()
        server.close(() => resolve())
      })
  }
}

/** one request through `git http-backend` (CGI): request body on stdin, CGI headers then body on stdout */
const gitBackend = (root: string, req: http.IncomingMessage, res: http.ServerResponse, url: URL) => {
  const child = spawn("git", ["http-backend"], {
    env: {
      PATH: process.env.PATH ?? "/usr/bin:/bin",
      GIT_PROJECT_ROOT: root,
      GIT_HTTP_EXPORT_ALL: "1",
      PATH_INFO: url.pathname,
      QUERY_STRING: url.search.slice(1),
      REQUEST_METHOD: req.method ?? "GET",
      CONTENT_TYPE: String(req.headers["content-type"] ?? ""),
      REMOTE_ADDR: "127.0.0.1",
      ...(req.headers["content-encoding"] === undefined
        ? {}
        : { HTTP_CONTENT_ENCODING: String(req.headers["content-encoding"]) }),
      ...(req.headers["git-protocol"] === undefined
        ? {}
        : { GIT_PROTOCOL: String(req.headers["git-protocol"]) })
    },
    stdio: ["pipe", "pipe", "inherit"]
  })
  req.pipe(child.stdin)
  let head = Buffer.alloc(0)
  let started = false
  child.stdout.on("data", (chunk: Buffer) => {
    if (started) return void res.write(chunk)
    head = Buffer.concat([head, chunk])
    const end = head.indexOf("\r\n\r\n")
    if (end < 0) return
    started = true
    let status = 200
    const headers: Record<string, string> = {}
    for (const line of head.subarray(0, end).toString("latin1").split("\r\n")) {
      const colon = line.indexOf(":")
      if (colon < 0) continue
      const key = line.slice(0, colon).trim()
      const value = line.slice(colon + 1).trim()
      if (key.toLowerCase() === "status") status = Number(value.split(" ")[0])
      else headers[key] = value
    }
    res.writeHead(status, headers)
    res.write(head.subarray(end + 4))
  })
  child.stdout.on("end", () => {
    if (!started) res.writeHead(502)
    res.end()
  })
}
