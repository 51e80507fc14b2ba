/**
 * Resume's compatibility check, the macOS cells (docs/compatibility.md): the whole host matrix
 * (OS × arch × backend) against recorded sessions, with the legacy backfill only on
 * macOS/arm64/vz. test/compat.test.ts holds the table's named cases; this walks every cell.
 */
import { describe, expect, it } from "@effect/vitest"
import * as Either from "effect/Either"
import * as fc from "fast-check"
import { checkCompatibility, type HostProfile } from "../src/programs/compat.js"
import type { GuestArch, VmmBackendName } from "../src/domain/session.js"
import type { SessionMeta } from "../src/services/SessionStore.js"

const oses: ReadonlyArray<NodeJS.Platform> = ["linux", "darwin"]
const arches: ReadonlyArray<GuestArch> = ["x86_64", "aarch64"]
const backends: ReadonlyArray<VmmBackendName> = ["qemu", "vz", "fake"]

const session = (guest?: { arch: GuestArch; protocol: number }, backend?: VmmBackendName): SessionMeta => ({
  format: 1,
  id: "s",
  created: "2026-01-01T00:00:00.000Z",
  source: "/src",
  model: "default",
  ...(guest === undefined ? {} : { guest }),
  ...(backend === undefined ? {} : { vmm: { backend } })
})

const verdict = (meta: SessionMeta, host: HostProfile) =>
  Either.match(checkCompatibility(meta, host), {
    onLeft: (e) => (e._tag === "SessionIncompatible" ? `incompatible:${e.field}` : "too-old"),
    onRight: (ok) => (ok.backfilled ? "backfilled" : "ok")
  })

describe("resume compatibility, every host cell", () => {
  it("a recorded session resumes exactly where arch and backend match, whatever the OS", () => {
    for (const os of oses)
      for (const arch of arches)
        for (const backend of backends)
          for (const recordedArch of arches)
            for (const recordedBackend of backends) {
              const got = verdict(session({ arch: recordedArch, protocol: 4 }, recordedBackend), {
                os,
                arch,
                backend
              })
              const expected =
                recordedArch !== arch
                  ? "incompatible:guest.arch"
                  : recordedBackend !== backend
                    ? "incompatible:vmm.backend"
                    : "ok"
              expect(`${os}/${arch}/${backend} ← ${recordedArch}/${recordedBackend}: ${got}`).toBe(
                `${os}/${arch}/${backend} ← ${recordedArch}/${recordedBackend}: ${expected}`
              )
            }
  })

  it("the legacy format (no metadata) is backfilled on darwin/aarch64/vz only, as aarch64 + vz", () => {
    for (const os of oses)
      for (const arch of arches)
        for (const backend of backends) {
          const host = { os, arch, backend }
          const expected =
            os === "darwin" && arch === "aarch64" && backend === "vz" ? "backfilled" : "incompatible:metadata"
          expect(`${os}/${arch}/${backend}: ${verdict(session(), host)}`).toBe(
            `${os}/${arch}/${backend}: ${expected}`
          )
        }
    const backfilled = Either.getOrThrow(
      checkCompatibility(session(), { os: "darwin", arch: "aarch64", backend: "vz" })
    )
    expect(backfilled).toMatchObject({ guest: { arch: "aarch64" }, vmm: { backend: "vz" }, backfilled: true })
  })

  it("property: a pre-v4 guest is refused before boot on every host where it would otherwise resume", () => {
    fc.assert(
      fc.property(
        fc.constantFrom(...oses),
        fc.constantFrom(...arches),
        fc.constantFrom(...backends),
        fc.integer({ min: 0, max: 3 }),
        (os, arch, backend, protocol) => {
          expect(verdict(session({ arch, protocol }, backend), { os, arch, backend })).toBe("too-old")
        }
      )
    )
  })

  it("an Intel Mac (x86_64, vz) resumes its own x86_64 sessions but never backfills", () => {
    const intel: HostProfile = { os: "darwin", arch: "x86_64", backend: "vz" }
    expect(verdict(session({ arch: "x86_64", protocol: 4 }, "vz"), intel)).toBe("ok")
    expect(verdict(session({ arch: "aarch64", protocol: 4 }, "vz"), intel)).toBe("incompatible:guest.arch")
    expect(verdict(session(), intel)).toBe("incompatible:metadata")
  })
})
