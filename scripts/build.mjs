// Bundles every entry point to one file each: start-up time is a feature (see docs/performance.md).
import { build } from "esbuild"
import { mkdir } from "node:fs/promises"

const entries = [
  // host CLI
  { in: "src/bin.ts", out: "abox" },
  // the VMM helper the supervisor spawns with a liveness pipe
  { in: "src/vmm/helper.ts", out: "abox-vmm" },
  // the guest agent baked into images
  { in: "src/guest/main.ts", out: "abox-guest" },
  // the SDK (library entry)
  { in: "src/sdk/index.ts", out: "sdk" }
]

const { existsSync, readdirSync, rmSync } = await import("node:fs")
await mkdir("dist", { recursive: true })
// the CLI's chunks of an earlier build (their names carry a content hash)
for (const file of readdirSync("dist")) if (file.startsWith("abox-chunk-")) rmSync(`dist/${file}`)
await Promise.all(
  entries
    .filter((entry) => existsSync(entry.in))
    .map((entry) =>
      build({
        entryPoints: [{ in: entry.in, out: entry.out }],
        // The CLI is split: each command's module (src/cli/dispatch.ts imports them dynamically)
        // and what commands share are chunks next to dist/abox.js, so a command evaluates only
        // what it needs (`abox list` never the VM stack). The chunks sit in dist/ itself, where
        // the modules that look for their neighbours by import.meta.url expect to be.
        ...(entry.out === "abox"
          ? { outdir: "dist", entryNames: "[name]", splitting: true, chunkNames: "abox-chunk-[hash]" }
          : { outfile: `dist/${entry.out}.js` }),
        bundle: true,
        platform: "node",
        target: "node20",
        format: "esm",
        sourcemap: "linked",
        legalComments: "none",
        // native addon: loaded from node_modules at run time
        external: ["fs-native-extensions", "require-addon"],
        banner: {
          js:
            (entry.out === "sdk" ? "" : "#!/usr/bin/env node\n") +
            "import { createRequire as __abox_createRequire } from 'node:module'; const require = __abox_createRequire(import.meta.url);"
        },
        logLevel: "warning"
      })
    )
)

// The guest's model agent (src/guest/model): loaded by the agent on the first prompt turn only
// (src/guest/prompts.ts), so the agent's start and its startup snapshot never carry the model stack.
// CommonJS so that both the ESM bundle and the snapshot load it with createRequire.
if (existsSync("src/guest/model/index.ts")) {
  await build({
    entryPoints: ["src/guest/model/index.ts"],
    outfile: "dist/abox-guest-model.cjs",
    bundle: true,
    platform: "node",
    target: "node20",
    format: "cjs",
    legalComments: "none",
    logLevel: "warning"
  })
}

// The guest agent's startup-snapshot entry (src/guest/snapshot.ts): one CommonJS script, as
// `node --build-snapshot` requires; images/build-small.sh turns it into /opt/abox/agent.blob.
if (existsSync("src/guest/snapshot.ts")) {
  await build({
    entryPoints: ["src/guest/snapshot.ts"],
    outfile: "dist/abox-guest-snapshot.cjs",
    bundle: true,
    platform: "node",
    target: "node20",
    format: "cjs",
    legalComments: "none",
    logLevel: "warning"
  })
}

// The SDK's type declarations (package.json "types": dist/types/sdk/index.d.ts), for consumers in
// strict TypeScript; tsconfig.build.json emits them and nothing else.
{
  const { spawnSync } = await import("node:child_process")
  const { rmSync } = await import("node:fs")
  rmSync("dist/types", { recursive: true, force: true })
  const tsc = spawnSync(process.execPath, ["node_modules/typescript/bin/tsc", "-p", "tsconfig.build.json"], {
    stdio: "inherit"
  })
  if (tsc.status !== 0) {
    console.error("build: emitting the SDK's declarations failed")
    process.exit(1)
  }
}
