/**
 * The startup-snapshot entry of the guest agent: bundled as CommonJS to
 * dist/abox-guest-snapshot.cjs and, at image-build time, run once by the guest's own node binary
 * (`node --snapshot-blob agent.blob --build-snapshot abox-guest-snapshot.cjs`). Building
 * evaluates every module (effect/Schema, the protocol, tar) into the V8 heap; a boot then runs
 * `node --snapshot-blob agent.blob [flags]`, which deserialises that heap and calls `main`
 * without parsing or evaluating a line of the bundle.
 *
 * Before anything else, the booted agent creates STARTED_MARKER: the image's init retries with
 * the plain bundle when node exits non-zero and the marker is absent (a rejected or broken blob).
 */
// Raw node:fs: one synchronous marker write before the agent's first await (the init reads it).
import * as fs from "node:fs"
import * as v8 from "node:v8"
import { main } from "./agentMain.js"

/** written by a snapshot boot before `main` runs; the init's fallback test (root-init.sh) */
const STARTED_MARKER = "/run/abox-agent.started"

if (!v8.startupSnapshot.isBuildingSnapshot()) {
  process.stderr.write("abox-guest: snapshot.ts is a --build-snapshot entry; run abox-guest.js instead\n")
  process.exit(64)
}

v8.startupSnapshot.setDeserializeMainFunction(() => {
  try {
    fs.writeFileSync(STARTED_MARKER, `${process.pid}\n`)
  } catch {
    // no /run (a run outside an image): the init's fallback is the only reader
  }
  // argv of a snapshot boot: [node, ...flags] (no script path)
  void main(process.argv.slice(1))
})
