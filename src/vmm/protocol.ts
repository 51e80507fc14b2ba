import { errorMessage } from "../domain/errorMessage.js"
/**
 * The supervisor ↔ abox-vmm contract. The supervisor writes one `HelperSpec` JSON line on the
 * helper's stdin; the helper answers with `HelperEvent` JSON lines on stdout. fd 3 is the
 * liveness pipe (EOF = the supervisor died), fd 4 the session's locked fd (passed on to the
 * VMM so the lock lives exactly as long as the VM).
 *
 * Plain TypeScript, no Effect: the helper is a small process on every VM's start-up path (and
 * alive for the whole session), so it carries no Effect runtime. This file is the one
 * definition of the contract on both sides: the types, a strict decoder for each direction
 * (every field checked, unknown fields refused) and the encoders.
 */
export const LIVENESS_FD = 3
export const LOCK_FD = 4

export interface HelperSpec {
  /** VMM binary and its argv (no secrets: see argv.ts) */
  readonly command: string
  readonly args: ReadonlyArray<string>
  readonly env: { readonly [key: string]: string }
  readonly consoleLog: string
  /** console.log is kept at most this big (the tail survives) */
  readonly consoleMaxBytes: number
  /** QMP socket for quit; absent → signals only */
  readonly qmpSocket?: string | undefined
  /** vfkit's RESTful API socket: POST /vm/state Stop, then HardStop, before the signal fallback */
  readonly restSocket?: string | undefined
  /**
   * the platform's fallback signal (SIGINT on macOS, SIGTERM on Linux; default: by the helper's
   * own platform): the supervisor stops the helper with it, and the helper sends it to the VMM
   */
  readonly signal?: "SIGINT" | "SIGTERM" | undefined
  /** the helper's own bounded stop: QMP quit → wait → SIGTERM → wait → SIGKILL */
  readonly quitMs: number
  readonly termMs: number
}

export type HelperEvent =
  | { readonly event: "started"; readonly pid: number }
  | { readonly event: "stopping"; readonly reason: string }
  | { readonly event: "exited"; readonly code: number | null; readonly signal: string | null }
  | { readonly event: "error"; readonly message: string }

/** a decoded line, or why it is not one (`path`: where in the value) */
export type Decoded<A> =
  { readonly ok: true; readonly value: A } | { readonly ok: false; readonly error: string }

class Invalid extends Error {
  constructor(
    readonly path: string,
    readonly expected: string,
    readonly actual: unknown
  ) {
    super(`${path}: expected ${expected}, got ${describe(actual)}`)
  }
}

const describe = (value: unknown): string => {
  if (value === undefined) return "absent"
  try {
    const text = JSON.stringify(value)
    return text.length > 80 ? `${text.slice(0, 77)}...` : text
  } catch {
    return typeof value
  }
}

type Check<A> = (value: unknown, path: string) => A

const string: Check<string> = (value, path) => {
  if (typeof value !== "string") throw new Invalid(path, "a string", value)
  return value
}
const number: Check<number> = (value, path) => {
  if (typeof value !== "number" || !Number.isFinite(value)) throw new Invalid(path, "a number", value)
  return value
}
const nullOr =
  <A>(check: Check<A>): Check<A | null> =>
  (value, path) =>
    value === null ? null : check(value, path)
const literal =
  <const L extends string>(...literals: ReadonlyArray<L>): Check<L> =>
  (value, path) => {
    if (!literals.includes(value as L))
      throw new Invalid(path, literals.map((l) => `"${l}"`).join(" or "), value)
    return value as L
  }
const isRecord = (value: unknown): value is Record<string, unknown> =>
  typeof value === "object" && value !== null && !Array.isArray(value)
const array =
  <A>(check: Check<A>): Check<Array<A>> =>
  (value, path) => {
    if (!Array.isArray(value)) throw new Invalid(path, "an array", value)
    return value.map((item, i) => check(item, `${path}[${i}]`))
  }
const stringRecord: Check<Record<string, string>> = (value, path) => {
  if (!isRecord(value)) throw new Invalid(path, "an object of strings", value)
  const out: Record<string, string> = {}
  for (const [key, item] of Object.entries(value)) out[key] = string(item, `${path}.${key}`)
  return out
}

/** an object with exactly these fields (`optional` ones may be absent), in this order */
const struct = <A>(
  fields: Record<string, Check<unknown>>,
  optional: ReadonlyArray<string> = []
): Check<A> => {
  const names = Object.keys(fields)
  return (value, path) => {
    if (!isRecord(value)) throw new Invalid(path, "an object", value)
    for (const key of Object.keys(value))
      if (!names.includes(key)) throw new Invalid(`${path}.${key}`, "no such field", value[key])
    const out: Record<string, unknown> = {}
    for (const name of names) {
      if (!(name in value) || value[name] === undefined) {
        if (optional.includes(name)) continue
        throw new Invalid(`${path}.${name}`, "a value", undefined)
      }
      out[name] = fields[name]!(value[name], `${path}.${name}`)
    }
    return out as A
  }
}

const checkSpec = struct<HelperSpec>(
  {
    command: string,
    args: array(string),
    env: stringRecord,
    consoleLog: string,
    consoleMaxBytes: number,
    qmpSocket: string,
    restSocket: string,
    signal: literal("SIGINT", "SIGTERM"),
    quitMs: number,
    termMs: number
  },
  ["qmpSocket", "restSocket", "signal"]
)

const eventChecks = {
  started: struct<HelperEvent>({ event: literal("started"), pid: number }),
  stopping: struct<HelperEvent>({ event: literal("stopping"), reason: string }),
  exited: struct<HelperEvent>({ event: literal("exited"), code: nullOr(number), signal: nullOr(string) }),
  error: struct<HelperEvent>({ event: literal("error"), message: string })
} as const

const checkEvent: Check<HelperEvent> = (value, path) => {
  if (!isRecord(value)) throw new Invalid(path, "an object", value)
  const tag = literal("started", "stopping", "exited", "error")(value["event"], `${path}.event`)
  return eventChecks[tag](value, path)
}

const decodeLine =
  <A>(check: Check<A>) =>
  (line: string): Decoded<A> => {
    let value: unknown
    try {
      value = JSON.parse(line)
    } catch (error) {
      return { ok: false, error: `not JSON: ${errorMessage(error)}` }
    }
    try {
      return { ok: true, value: check(value, "$") }
    } catch (error) {
      if (!(error instanceof Invalid)) throw error
      return { ok: false, error: error.message }
    }
  }

/** one line from the supervisor (without its newline) → the spec, strictly checked */
export const decodeHelperSpec = decodeLine(checkSpec)
/** one line from the helper → the event, strictly checked */
export const decodeHelperEvent = decodeLine(checkEvent)
/** the spec as one JSON line (fields in the contract's order, absent ones left out) */
export const encodeHelperSpec = (spec: HelperSpec): string => JSON.stringify(checkSpec(spec, "$"))
/** the event as one JSON line */
export const encodeHelperEvent = (event: HelperEvent): string => JSON.stringify(checkEvent(event, "$"))
