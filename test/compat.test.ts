import { describe, expect, it } from "@effect/vitest"
import * as Either from "effect/Either"
import { checkCompatibility, type HostProfile } from "../src/programs/compat.js"
import type { SessionMeta } from "../src/services/SessionStore.js"

const base: SessionMeta = {
  format: 1,
  id: "s1",
  created: "2026-01-01T00:00:00.000Z",
  source: "/src",
  model: "default",
  guest: { arch: "x86_64", protocol: 4 },
  vmm: { backend: "qemu" }
}
const linux: HostProfile = { os: "linux", arch: "x86_64", backend: "qemu" }
const mac: HostProfile = { os: "darwin", arch: "aarch64", backend: "vz" }
const { guest: _g, vmm: _v, ...legacy } = base

const tagOf = (result: ReturnType<typeof checkCompatibility>) =>
  Either.match(result, { onLeft: (e) => `${e._tag}:${"field" in e ? e.field : e.protocol}`, onRight: () => "ok" })

describe("resume compatibility matrix (host OS × arch × backend)", () => {
  it("accepts a session recorded on this kind of host", () => {
    expect(tagOf(checkCompatibility(base, linux))).toBe("ok")
    const onMac = { ...base, guest: { arch: "aarch64", protocol: 4 }, vmm: { backend: "vz" } } as const
    expect(tagOf(checkCompatibility(onMac, mac))).toBe("ok")
  })

  it("rejects a foreign guest architecture, naming both sides", () => {
    const arm = { ...base, guest: { arch: "aarch64", protocol: 4 } } as const
    const result = checkCompatibility(arm, linux)
    expect(tagOf(result)).toBe("SessionIncompatible:guest.arch")
    Either.mapLeft(result, (e) => expect(e.message).toMatch(/aarch64.*x86_64/))
  })

  it("rejects another backend", () => {
    const vz = { ...base, vmm: { backend: "vz" } } as const
    expect(tagOf(checkCompatibility(vz, linux))).toBe("SessionIncompatible:vmm.backend")
    expect(tagOf(checkCompatibility(base, { ...linux, backend: "fake" }))).toBe("SessionIncompatible:vmm.backend")
  })

  it("rejects a guest older than protocol 4 before booting", () => {
    expect(tagOf(checkCompatibility({ ...base, guest: { arch: "x86_64", protocol: 3 } }, linux))).toBe("GuestTooOld:3")
  })

  it("Linux rejects sessions that predate the metadata", () => {
    expect(tagOf(checkCompatibility(legacy, linux))).toBe("SessionIncompatible:metadata")
    expect(tagOf(checkCompatibility(legacy, { os: "linux", arch: "aarch64", backend: "qemu" }))).toBe(
      "SessionIncompatible:metadata"
    )
  })

  it("only macOS/arm64 with vz backfills the legacy format", () => {
    const result = checkCompatibility(legacy, mac)
    expect(Either.getOrThrow(result)).toEqual({
      guest: { arch: "aarch64", protocol: 4 },
      vmm: { backend: "vz" },
      backfilled: true
    })
    expect(tagOf(checkCompatibility(legacy, { os: "darwin", arch: "x86_64", backend: "vz" }))).toBe(
      "SessionIncompatible:metadata"
    )
    expect(tagOf(checkCompatibility(legacy, { os: "darwin", arch: "aarch64", backend: "qemu" }))).toBe(
      "SessionIncompatible:metadata"
    )
  })
})
