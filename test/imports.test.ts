import { describe, expect, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as path from "node:path"
import ts from "typescript"

/**
 * The import direction of src/ (docs/source-layout.md). Each file belongs to an
 * area (its folder under src/); an area may import only the areas listed for it. So nothing runs
 * back up: the domain imports nothing of ours, services (contracts) never reach an
 * implementation, lib never reaches a service, and the guest (bundled into the image) only the
 * domain and the protocol.
 */
const SRC = path.resolve(import.meta.dirname, "..", "src")

type Area =
  | "domain"
  | "protocol"
  | "services"
  | "lib"
  | "brokerPolicy"
  | "broker"
  | "vmm"
  | "guest"
  | "layers"
  | "programs"
  | "cli"
  | "sdk"
  | "bin"

const BELOW_LAYERS: ReadonlyArray<Area> = [
  "domain",
  "protocol",
  "services",
  "lib",
  "brokerPolicy",
  "broker",
  "vmm"
]

const ALLOWED: Record<Area, ReadonlyArray<Area>> = {
  domain: ["domain"],
  protocol: ["domain", "protocol"],
  services: ["domain", "protocol", "brokerPolicy", "services"],
  lib: ["domain", "protocol", "brokerPolicy", "lib"],
  // the broker's policy (a schema and pure host/address rules): what session.json and the
  // HttpsBroker contract carry, so services and lib may name it
  brokerPolicy: ["domain", "brokerPolicy"],
  broker: ["domain", "protocol", "services", "lib", "brokerPolicy", "broker"],
  // the VMM helper process and the host-side supervisor of it
  vmm: ["domain", "protocol", "lib", "vmm"],
  guest: ["domain", "protocol", "guest"],
  layers: [...BELOW_LAYERS, "layers"],
  programs: [...BELOW_LAYERS, "programs"],
  cli: [...BELOW_LAYERS, "layers", "programs", "cli"],
  sdk: [...BELOW_LAYERS, "layers", "programs", "sdk"],
  bin: [...BELOW_LAYERS, "layers", "programs", "cli"]
}

/**
 * Single files that cross the rule, each with its reason. An exception that no longer matches
 * an import fails the test, so the list only shrinks.
 */
const EXCEPTIONS: ReadonlyArray<{ readonly from: string; readonly to: string; readonly why: string }> = [
  {
    from: "lib/hostExtract.ts",
    to: "guest/extract.ts",
    why: "the tar reader with the guest's path rules: the host reads the guest's archives with the same code"
  },
  {
    from: "lib/oci/rootfs.ts",
    to: "guest/extract.ts",
    why: "an OCI image's layers are applied by the same checked tar reader (its layer mode)"
  },
  {
    from: "programs/imageImport.ts",
    to: "guest/extract.ts",
    why: "an image archive is unpacked by the same checked tar reader"
  },
  {
    from: "programs/repo.ts",
    to: "guest/extract.ts",
    why: "the same path rules for `abox cp` destinations"
  }
]

/** the area of a file, by its path under src/ (the broker's pure policy is an area of its own) */
const areaOf = (rel: string): Area | undefined => {
  if (/^broker\/(policy|address|host)\.ts$/.test(rel)) return "brokerPolicy"
  if (rel === "bin.ts") return "bin"
  const top = rel.split("/")[0] ?? ""
  return top in ALLOWED ? (top as Area) : undefined
}

const sourceFiles = (dir: string): Array<string> =>
  fs.readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const full = path.join(dir, entry.name)
    if (entry.isDirectory()) return sourceFiles(full)
    return entry.name.endsWith(".ts") && !entry.name.endsWith(".d.ts") ? [full] : []
  })

interface Edge {
  readonly from: string
  readonly to: string
}

/** every relative import (static, re-export, dynamic) of every file, as paths under src/ */
const edges = (): {
  readonly files: ReadonlyArray<string>
  readonly edges: ReadonlyArray<Edge>
  readonly external: ReadonlyArray<Edge>
} => {
  const files = sourceFiles(SRC).map((f) => path.relative(SRC, f).split(path.sep).join("/"))
  const internal: Array<Edge> = []
  const external: Array<Edge> = []
  for (const from of files) {
    const info = ts.preProcessFile(fs.readFileSync(path.join(SRC, from), "utf8"), true, true)
    for (const { fileName } of info.importedFiles) {
      if (!fileName.startsWith(".")) {
        external.push({ from, to: fileName })
        continue
      }
      const target = path.posix.normalize(path.posix.join(path.posix.dirname(from), fileName))
      internal.push({ from, to: target.replace(/\.js$/, ".ts") })
    }
  }
  return { files, edges: internal, external }
}

describe("import direction", () => {
  const graph = edges()

  it("every source file belongs to an area with a rule", () => {
    expect(graph.files.length).toBeGreaterThan(50)
    expect(graph.files.filter((f) => areaOf(f) === undefined)).toEqual([])
  })

  it("no import runs against the direction (src/domain → protocol → services → lib → layers/programs → cli/sdk)", () => {
    const wrong = graph.edges
      .filter((e) => !e.to.startsWith("../")) // package.json (the version)
      .filter((e) => {
        const from = areaOf(e.from)
        const to = areaOf(e.to)
        if (from === undefined || to === undefined) return true
        if (ALLOWED[from].includes(to)) return false
        return !EXCEPTIONS.some((x) => x.from === e.from && x.to === e.to)
      })
      .map((e) => `${e.from} → ${e.to} (${areaOf(e.from)} may not import ${areaOf(e.to)})`)
    expect(wrong).toEqual([])
  })

  it("each exception is still needed", () => {
    const stale = EXCEPTIONS.filter((x) => !graph.edges.some((e) => e.from === x.from && e.to === x.to))
    expect(stale).toEqual([])
  })

  it("the domain imports only effect and node:path", () => {
    const outside = graph.external
      .filter((e) => areaOf(e.from) === "domain")
      .filter((e) => !e.to.startsWith("effect/") && e.to !== "node:path")
      .map((e) => `${e.from} → ${e.to}`)
    expect(outside).toEqual([])
  })

  it("the checker sees a wrong import (a rule that cannot fail proves nothing)", () => {
    expect(areaOf("lib/x.ts")).toBe("lib")
    expect(ALLOWED.lib.includes(areaOf("services/SessionStore.ts")!)).toBe(false)
    expect(ALLOWED.domain.includes(areaOf("lib/text.ts")!)).toBe(false)
    expect(areaOf("broker/channel.ts")).toBe("broker")
    expect(areaOf("broker/policy.ts")).toBe("brokerPolicy")
    expect(graph.edges.some((e) => e.from === "layers/Main.ts" && areaOf(e.to) === "services")).toBe(true)
  })
})
