/**
 * `abox scrub` over memory states (src/programs/scrubStates.ts): a secret is found whole
 * wherever the stream's chunks cut it, counted once, in raw and zstd states; a state is never
 * changed; an unreadable state is a problem, not a failure; the CLI reports it (real zstd, the
 * built CLI).
 */
import * as NodeContext from "@effect/platform-node/NodeContext"
import { describe, expect, it } from "@effect/vitest"
import * as Chunk from "effect/Chunk"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Stream from "effect/Stream"
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { scanMemoryStates, scanStream } from "../src/programs/scrubStates.js"
import { aboxPathsAt } from "../src/services/AboxPaths.js"

const SECRET = "sk-ant-api03-" + "M".repeat(40)
const hasZstd = spawnSync("zstd", ["--version"]).status === 0
const cli = path.resolve(import.meta.dirname, "..", "dist", "abox.js")

/** guest-memory-like bytes, with the secret at `at` */
const stateBytes = (size: number, at: ReadonlyArray<number>): Buffer => {
  // text that never forms a secret's shape
  const bytes = Buffer.alloc(size, "page of guest memory. ")
  for (const offset of at) bytes.write(SECRET, offset, "latin1")
  return bytes
}

const manifest = (compression: "zstd" | "raw", bytes: number) => ({
  format: 1,
  qemuVersion: "QEMU emulator version 7.2.0",
  machine: "pc-q35-7.2",
  layoutDigest: "0".repeat(64),
  memoryMiB: 512,
  cpus: 2,
  imageDigest: "1".repeat(64),
  compression,
  bytes,
  savedAt: new Date(0).toISOString()
})

const sessionWithState = (home: string, id: string, compression: "zstd" | "raw", bytes: Buffer) => {
  const dir = path.join(home, "sessions", id)
  fs.mkdirSync(dir, { recursive: true })
  const state = path.join(dir, "memory.state")
  if (compression === "raw") fs.writeFileSync(state, bytes, { mode: 0o600 })
  else {
    const raw = path.join(dir, "raw.tmp")
    fs.writeFileSync(raw, bytes)
    expect(spawnSync("zstd", ["-1", "-q", "--rm", raw, "-o", state]).status).toBe(0)
  }
  fs.writeFileSync(
    path.join(dir, "memory.json"),
    JSON.stringify(manifest(compression, fs.statSync(state).size))
  )
  return state
}

const layerAt = (home: string) => Layer.merge(aboxPathsAt(home), NodeContext.layer)

describe("memory state scrub", () => {
  it.effect("a secret cut by any chunk boundary is found once; two are counted twice", () =>
    Effect.gen(function* () {
      const bytes = stateBytes(20_000, [5_000, 12_000])
      for (const chunk of [1, 7, 64, 4096, 5_010, 20_000]) {
        const pieces: Array<Uint8Array> = []
        for (let i = 0; i < bytes.length; i += chunk) pieces.push(bytes.subarray(i, i + chunk))
        const scan = yield* scanStream(Stream.fromChunk(Chunk.fromIterable(pieces)))
        expect([chunk, scan.count, scan.kinds]).toEqual([chunk, 2, ["anthropic-key"]])
      }
      expect((yield* scanStream(Stream.make(stateBytes(9_000, [])))).count).toBe(0)
      expect((yield* scanStream(Stream.empty)).count).toBe(0)
    })
  )

  it.effect.skipIf(!hasZstd)(
    "raw and zstd states of several MiB are scanned; nothing is written; a corrupt state or manifest is a problem",
    () => {
      const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-scrub-states-"))
      // across the 1 MiB read chunks of a raw state
      const raw = sessionWithState(home, "a-raw", "raw", stateBytes(3 * 1024 * 1024, [1024 * 1024 - 10]))
      const zstd = sessionWithState(
        home,
        "b-zstd",
        "zstd",
        stateBytes(3 * 1024 * 1024, [2 * 1024 * 1024 - 3])
      )
      sessionWithState(home, "c-clean", "zstd", stateBytes(1024 * 1024, []))
      const corrupt = sessionWithState(home, "d-corrupt", "zstd", stateBytes(4096, []))
      fs.writeFileSync(corrupt, "not zstd at all")
      const badManifest = sessionWithState(home, "e-manifest", "raw", stateBytes(4096, [100]))
      fs.writeFileSync(path.join(path.dirname(badManifest), "memory.json"), "{")
      // a state without its manifest is not a state (an interrupted save): not read
      fs.mkdirSync(path.join(home, "sessions", "f-partial"))
      fs.writeFileSync(path.join(home, "sessions", "f-partial", "memory.state"), SECRET)
      const before = [raw, zstd].map((f) => fs.readFileSync(f))
      return Effect.gen(function* () {
        const report = yield* scanMemoryStates()
        expect(report.statesScanned).toBe(5)
        expect(report.findings.map((f) => [f.sessionId, f.count, f.kinds, f.changed])).toEqual([
          ["a-raw", 1, ["anthropic-key"], false],
          ["b-zstd", 1, ["anthropic-key"], false]
        ])
        expect(report.problems.map((p) => p.path)).toEqual([corrupt, badManifest])
        expect([raw, zstd].map((f, i) => fs.readFileSync(f).equals(before[i]!))).toEqual([true, true])
      }).pipe(
        Effect.provide(layerAt(home)),
        Effect.ensuring(Effect.sync(() => fs.rmSync(home, { recursive: true, force: true })))
      )
    },
    60_000
  )

  it.skipIf(!hasZstd || !fs.existsSync(cli))(
    "abox scrub reports a state's secret, exits 0 and leaves it",
    () => {
      const home = fs.mkdtempSync(path.join(os.tmpdir(), "abox-scrub-states-cli-"))
      try {
        const state = sessionWithState(home, "s", "zstd", stateBytes(64 * 1024, [30_000]))
        const before = fs.readFileSync(state)
        const env = { PATH: process.env.PATH ?? "", HOME: home, ABOX_HOME: home }
        const json = spawnSync(process.execPath, [cli, "scrub", "--json"], { env, encoding: "utf8" })
        expect(json.status, json.stderr).toBe(0)
        const report = JSON.parse(json.stdout) as {
          memoryStatesScanned: number
          findings: Array<{ path: string; changed: boolean; kinds: Array<string> }>
        }
        expect(report.memoryStatesScanned).toBe(1)
        expect(report.findings).toEqual([
          expect.objectContaining({ path: state, changed: false, kinds: ["anthropic-key"] })
        ])
        const text = spawnSync(process.execPath, [cli, "scrub"], { env, encoding: "utf8" })
        expect(text.status).toBe(0)
        expect(text.stdout).toContain("1 memory state(s)")
        expect(text.stdout).toContain(
          `${state}: found (left as it is: it is the guest's memory) 1 secret(s) (anthropic-key)`
        )
        expect(text.stdout).not.toContain(SECRET)
        expect(fs.readFileSync(state).equals(before)).toBe(true)
      } finally {
        fs.rmSync(home, { recursive: true, force: true })
      }
    },
    60_000
  )
})
