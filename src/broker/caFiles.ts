import * as FileSystem from "@effect/platform/FileSystem"
import * as Effect from "effect/Effect"
import * as crypto from "node:crypto"
import * as os from "node:os"
import * as path from "node:path"

/** a policy's host file: absolute, or `~/…` (the host user's home) */
export const expandHome = (file: string) =>
  file === "~" || file.startsWith("~/") ? path.join(os.homedir(), file.slice(1)) : file

/**
 * The CA certificates of a PEM file the host's user names for the guest (policy `guestCaFiles`):
 * every PEM block must be a certificate that parses as X.509 (a private key, a CSR or a broken
 * block is refused, never passed on), and at least one must be there. Only the certificate
 * blocks, re-encoded, are kept: text around them (a bundle's comments) stays on the host.
 */
export type CaFileCheck =
  | {
      readonly ok: true
      readonly pems: ReadonlyArray<string>
      /** each certificate's subject (for doctor) */
      readonly subjects: ReadonlyArray<string>
    }
  | { readonly ok: false; readonly reason: string }

/** a trust file larger than this is not a CA list */
export const MAX_CA_FILE_BYTES = 1024 * 1024

const BLOCK = /-----BEGIN ([A-Z0-9 ]+)-----([\s\S]*?)-----END \1-----/g

export const checkCaPem = (text: string): CaFileCheck => {
  if (text.length > MAX_CA_FILE_BYTES) return { ok: false, reason: `larger than ${MAX_CA_FILE_BYTES} bytes` }
  const pems: Array<string> = []
  const subjects: Array<string> = []
  const begins = text.match(/-----BEGIN /g)?.length ?? 0
  let blocks = 0
  for (const match of text.matchAll(BLOCK)) {
    blocks++
    const label = match[1]!
    if (label !== "CERTIFICATE")
      return { ok: false, reason: `it holds a ${label} block, not only certificates` }
    const body = match[2]!.replace(/\s+/g, "")
    if (!/^[A-Za-z0-9+/]+=*$/.test(body)) return { ok: false, reason: `certificate ${blocks} is not base64` }
    let cert: crypto.X509Certificate
    try {
      cert = new crypto.X509Certificate(Buffer.from(body, "base64"))
    } catch {
      return { ok: false, reason: `certificate ${blocks} does not parse as X.509` }
    }
    pems.push(cert.toString())
    subjects.push(cert.subject.replace(/\n/g, ", "))
  }
  if (begins !== blocks) return { ok: false, reason: "a PEM block is not closed" }
  if (pems.length === 0) return { ok: false, reason: "no PEM certificate in it" }
  return { ok: true, pems, subjects }
}

/** read and check one CA file of the policy (absolute or `~/…`); fails with the reason */
export const readCaFile = (
  file: string
): Effect.Effect<Extract<CaFileCheck, { ok: true }>, string, FileSystem.FileSystem> =>
  Effect.gen(function* () {
    const fs = yield* FileSystem.FileSystem
    const full = expandHome(file)
    const info = yield* fs.stat(full).pipe(Effect.mapError((cause) => cause.message))
    if (info.type !== "File" || Number(info.size) > MAX_CA_FILE_BYTES)
      return yield* Effect.fail(`not a file of at most ${MAX_CA_FILE_BYTES} bytes`)
    const text = yield* fs.readFileString(full).pipe(Effect.mapError((cause) => cause.message))
    const checked = checkCaPem(text)
    return checked.ok ? checked : yield* Effect.fail(checked.reason)
  })
