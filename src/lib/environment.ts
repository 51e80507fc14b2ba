/**
 * A repository's environment, read from its directory (docs/environments.md):
 * `.abox/environment.json`, else `.devcontainer/devcontainer.json` (JSON with comments), else
 * none. Everything read is the repository's, so untrusted: sizes are bounded, paths stay inside
 * the repository, and a file that does not decode is an `EnvironmentInvalid` naming the field.
 */
import * as Effect from "effect/Effect"
import * as ParseResult from "effect/ParseResult"
import * as Schema from "effect/Schema"
import * as crypto from "node:crypto"
import * as fs from "node:fs/promises"
import * as path from "node:path"
import {
  DEVCONTAINER_FIELDS,
  type DevcontainerCommand,
  DevcontainerFile,
  EnvironmentFile,
  EnvironmentInvalid,
  type EnvVars
} from "../domain/environment.js"
import { errorMessage } from "../domain/errorMessage.js"

export const ENVIRONMENT_FILE = path.join(".abox", "environment.json")
export const DEVCONTAINER_FILE = path.join(".devcontainer", "devcontainer.json")
export const DEFAULT_SETUP = path.join(".abox", "setup.sh")
export const DEFAULT_BASE = "abox-full"
/** an environment file or setup script larger than this is refused */
export const MAX_ENVIRONMENT_BYTES = 256 * 1024

/** What Open and `abox env build` act on. */
export interface RepoEnvironment {
  readonly kind: "abox" | "devcontainer"
  /** the repository directory (resolved) */
  readonly source: string
  /** the file it came from, relative to the repository */
  readonly file: string
  /** its bytes (part of the key) */
  readonly fileText: string
  /** a base image reference: a registered image's name or name@digest */
  readonly base: string
  /** how the devcontainer named its image (for the error when none is registered under it) */
  readonly imageReference?: string | undefined
  /** the setup: a shell command line run as root in /work/repo, and the script's bytes (key) */
  readonly setup?: { readonly command: string; readonly script: string } | undefined
  readonly install?: string | undefined
  readonly env: EnvVars
  readonly forward: ReadonlyArray<number>
  readonly allow: ReadonlyArray<string>
  readonly cpus?: number | undefined
  readonly memoryMiB?: number | undefined
  /** devcontainer.json fields abox does not read */
  readonly ignored: ReadonlyArray<string>
}

/**
 * JSON with comments (devcontainer.json) as JSON: `//` and `/* *\/` comments and trailing commas
 * go, strings stay as they are (a `//` inside a string is text). Offsets are kept (comments
 * become spaces) so that a parse error points where the file has it.
 */
export const stripJsonc = (text: string): string => {
  let out = ""
  let i = 0
  const n = text.length
  while (i < n) {
    const c = text[i]!
    if (c === '"') {
      let j = i + 1
      while (j < n && text[j] !== '"') j += text[j] === "\\" ? 2 : 1
      out += text.slice(i, j + 1)
      i = j + 1
    } else if (c === "/" && text[i + 1] === "/") {
      let j = i
      while (j < n && text[j] !== "\n") j++
      out += " ".repeat(j - i)
      i = j
    } else if (c === "/" && text[i + 1] === "*") {
      const end = text.indexOf("*/", i + 2)
      const j = end === -1 ? n : end + 2
      out += text.slice(i, j).replace(/[^\n]/g, " ")
      i = j
    } else if (c === ",") {
      // a trailing comma: only blanks (and comments, already blanks once reached) before } or ]
      let j = i + 1
      let rest = ""
      while (j < n) {
        if (/\s/.test(text[j]!)) {
          j++
        } else if (text[j] === "/" && text[j + 1] === "/") {
          while (j < n && text[j] !== "\n") j++
        } else if (text[j] === "/" && text[j + 1] === "*") {
          const end = text.indexOf("*/", j + 2)
          j = end === -1 ? n : end + 2
        } else {
          rest = text[j]!
          break
        }
      }
      out += rest === "}" || rest === "]" ? " " : ","
      i++
    } else {
      out += c
      i++
    }
  }
  return out
}

const readBounded = (root: string, relative: string) =>
  Effect.tryPromise({
    try: async () => {
      const file = path.join(root, relative)
      const stat = await fs.lstat(file).catch((error: NodeJS.ErrnoException) => {
        if (error.code === "ENOENT") return undefined
        throw error
      })
      if (stat === undefined) return undefined
      if (!stat.isFile()) throw new Error("not a regular file (a link or a directory)")
      // a linked directory on the way (`.abox -> /somewhere`) would read a file outside the repository
      const [real, realRoot] = await Promise.all([fs.realpath(file), fs.realpath(root)])
      if (!real.startsWith(realRoot + path.sep)) throw new Error(`it resolves outside the repository (${real})`)
      if (stat.size > MAX_ENVIRONMENT_BYTES) throw new Error(`larger than ${MAX_ENVIRONMENT_BYTES} bytes`)
      return await fs.readFile(file, "utf8")
    },
    catch: (cause) =>
      new EnvironmentInvalid({ path: path.join(root, relative), message: `${relative}: ${errorMessage(cause)}` })
  })

/** the first failing field of a decode, as `a.b.c` (the message names it too) */
const invalid = (file: string, error: ParseResult.ParseError) => {
  const issues = ParseResult.ArrayFormatter.formatErrorSync(error)
  const first = issues[0]
  const field = first === undefined || first.path.length === 0 ? undefined : first.path.map(String).join(".")
  return new EnvironmentInvalid({
    path: file,
    ...(field === undefined ? {} : { field }),
    message: `${file}: ${field === undefined ? "" : `${field}: `}${first?.message ?? ParseResult.TreeFormatter.formatErrorSync(error)}`
  })
}

const decodeJson = <A, I>(schema: Schema.Schema<A, I>, file: string, text: string, options?: ParseOptions) =>
  Effect.gen(function* () {
    const value = yield* Schema.decodeUnknown(Schema.parseJson())(text).pipe(
      Effect.mapError(
        (error) =>
          new EnvironmentInvalid({
            path: file,
            message: `${file} is not JSON: ${ParseResult.TreeFormatter.formatErrorSync(error)}`
          })
      )
    )
    if (typeof value !== "object" || value === null || Array.isArray(value))
      return yield* new EnvironmentInvalid({ path: file, message: `${file}: not a JSON object` })
    return yield* Schema.decodeUnknown(schema)(value, options).pipe(Effect.mapError((error) => invalid(file, error)))
  })

type ParseOptions = { readonly onExcessProperty: "error" | "ignore" }

/** a path the repository names, kept inside it: relative, no `..` out */
const insideRepo = (file: string, field: string, relative: string) => {
  const normal = path.posix.normalize(relative)
  return path.isAbsolute(relative) || normal === ".." || normal.startsWith("../")
    ? Effect.fail(
        new EnvironmentInvalid({ path: file, field, message: `${file}: ${field}: ${relative} is outside the repository` })
      )
    : Effect.succeed(normal)
}

const shellQuote = (word: string): string => `'${word.replaceAll("'", `'\\''`)}'`

/** a devcontainer command (string: a shell line; array: argv; object: each in turn) as one shell line */
export const commandLine = (command: DevcontainerCommand): string => {
  if (typeof command === "string") return command
  if (Array.isArray(command)) return (command as ReadonlyArray<string>).map((word) => shellQuote(word)).join(" ")
  return Object.values(command as Record<string, string | ReadonlyArray<string>>)
    .map((part) => `(${commandLine(part)})`)
    .join(" && ")
}

/** the environment of the repository at `source`, or undefined when it has none */
export const readEnvironment = Effect.fn("environment.read")(function* (source: string) {
  const own = yield* readBounded(source, ENVIRONMENT_FILE)
  if (own !== undefined) {
    const file = path.join(source, ENVIRONMENT_FILE)
    const config = yield* decodeJson(EnvironmentFile, file, own, { onExcessProperty: "error" })
    const setupFile = yield* insideRepo(file, "setup", config.setup ?? DEFAULT_SETUP)
    const script = yield* readBounded(source, setupFile)
    if (script === undefined && config.setup !== undefined) {
      return yield* new EnvironmentInvalid({
        path: file,
        field: "setup",
        message: `${file}: setup: ${setupFile} does not exist in the repository`
      })
    }
    return {
      kind: "abox",
      source,
      file: ENVIRONMENT_FILE,
      fileText: own,
      base: config.base ?? DEFAULT_BASE,
      setup:
        script === undefined
          ? undefined
          : { command: `/bin/sh ${shellQuote(path.posix.join("/work/repo", setupFile))}`, script },
      install: config.install,
      env: config.env ?? {},
      forward: config.forward ?? [],
      allow: config.allow ?? [],
      cpus: config.cpus,
      memoryMiB: config.memory,
      ignored: []
    } satisfies RepoEnvironment
  }
  const dev = yield* readBounded(source, DEVCONTAINER_FILE)
  if (dev === undefined) return undefined
  const file = path.join(source, DEVCONTAINER_FILE)
  const stripped = stripJsonc(dev)
  const config = yield* decodeJson(DevcontainerFile, file, stripped, { onExcessProperty: "ignore" })
  const raw = (yield* Schema.decodeUnknown(Schema.parseJson(Schema.Record({ key: Schema.String, value: Schema.Unknown })))(
    stripped
  ).pipe(Effect.orElseSucceed(() => ({})))) as Record<string, unknown>
  const ignored = Object.keys(raw).filter((key) => !(DEVCONTAINER_FIELDS as ReadonlyArray<string>).includes(key))
  const forward = (config.forwardPorts ?? []).flatMap((port) => (typeof port === "number" ? [port] : []))
  for (const port of config.forwardPorts ?? []) if (typeof port === "string") ignored.push(`forwardPorts "${port}"`)
  const setup = config.onCreateCommand === undefined ? undefined : commandLine(config.onCreateCommand)
  return {
    kind: "devcontainer",
    source,
    file: DEVCONTAINER_FILE,
    fileText: dev,
    base: config.image ?? DEFAULT_BASE,
    imageReference: config.image,
    setup: setup === undefined ? undefined : { command: setup, script: setup },
    install: config.postCreateCommand === undefined ? undefined : commandLine(config.postCreateCommand),
    env: { ...config.containerEnv, ...config.remoteEnv },
    forward,
    allow: [],
    cpus: undefined,
    memoryMiB: undefined,
    ignored
  } satisfies RepoEnvironment
})

/**
 * The environment image's key: the base image's digest, the setup script and the environment
 * file, each length-prefixed. An environment with no setup has no image of its own.
 */
export const environmentKey = (baseDigest: string, environment: RepoEnvironment): string =>
  crypto
    .createHash("sha256")
    .update(
      JSON.stringify([
        "abox-environment-1",
        baseDigest,
        environment.file,
        environment.fileText,
        environment.setup?.command ?? "",
        environment.setup?.script ?? ""
      ])
    )
    .digest("hex")

/** the registered name of an environment image: `env-` and the key's first 16 hex digits */
export const environmentImageName = (key: string): string => `env-${key.slice(0, 16)}`
