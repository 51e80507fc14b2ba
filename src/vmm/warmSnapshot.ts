/**
 * An image's warm snapshot (docs/on-disk.md "Warm snapshots"): the memory and device state of its
 * golden booted once in the warm layout (src/vmm/argv.ts `warm`: no config or repository disk,
 * the agent waiting for its session), saved over QMP, restored by `-incoming` at every warm Open.
 *
 * What can make a state file unusable is in its key (content-addressed: a directory per key), and
 * the manifest beside it repeats the key's inputs so that a file moved or damaged is told apart:
 * the image's digest, the QEMU version, the argv layout (every word but the files it names), the
 * memory and CPUs.
 *
 * Save, QEMU 7.2 (no `file:` URI): lift the 128 MiB/s migration cap, `migrate` (live: the VM
 * saved running is running once restored, no `cont` needed) to `exec:cat > file`, wait for
 * `completed` (QEMU pauses the source then), then the VM is quit by its scope.
 */
import * as crypto from "node:crypto"
import * as Schema from "effect/Schema"
import { type WarmInputs, WarmManifest } from "../domain/warm.js"
import { qmpCommand, QmpError } from "./qmp.js"
import { shellQuote } from "./argv.js"

export const decodeWarmManifest = Schema.decodeUnknownEither(Schema.parseJson(WarmManifest))
export const encodeWarmManifest = Schema.encodeSync(Schema.parseJson(WarmManifest, { space: 2 }))

export const warmKey = (inputs: WarmInputs): string =>
  crypto
    .createHash("sha256")
    .update(
      JSON.stringify([inputs.imageDigest, inputs.qemuVersion, inputs.layout, inputs.cpus, inputs.memoryMiB])
    )
    .digest("hex")
    .slice(0, 32)

/** why a manifest does not describe the snapshot these inputs need, or undefined when it does */
export const manifestMismatch = (manifest: WarmManifest, inputs: WarmInputs): string | undefined => {
  if (manifest.imageDigest !== inputs.imageDigest) return `it is of image ${manifest.imageDigest}`
  if (manifest.qemuVersion !== inputs.qemuVersion)
    return `it was saved by QEMU ${manifest.qemuVersion}, this is ${inputs.qemuVersion}`
  if (manifest.cpus !== inputs.cpus || manifest.memoryMiB !== inputs.memoryMiB)
    return `it has ${manifest.cpus} CPUs and ${manifest.memoryMiB} MiB, not ${inputs.cpus} and ${inputs.memoryMiB}`
  if (JSON.stringify(manifest.layout) !== JSON.stringify(inputs.layout)) return "its VM layout differs"
  // the fields agree: a key that does not is a manifest edited or moved under another key
  if (manifest.key !== warmKey(inputs)) return "its key is not the one of its contents"
  return undefined
}

const delay = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms))

/**
 * Saves the running VM's state into `stateFile` (QEMU writes it through `cat`); resolves when
 * QEMU reports the migration `completed`, rejects on `failed`/`cancelled`, a QMP error or after
 * `timeoutMs`. The VM is left paused by the migration: the caller quits it.
 */
export const saveState = async (qmpSocket: string, stateFile: string, timeoutMs = 120_000): Promise<void> => {
  await qmpCommand(qmpSocket, "migrate-set-parameters", 2000, { "max-bandwidth": 17179869184 })
  // no `stop` first: the stream records the run state, and a VM saved running starts running
  // as soon as `-incoming` has loaded it (the idle guest's few dirty pages converge at once)
  await qmpCommand(qmpSocket, "migrate", 2000, { uri: `exec:cat > ${shellQuote(stateFile)}` })
  const deadline = Date.now() + timeoutMs
  // QMP's MIGRATION event would need a connection held open; the status is asked every 50 ms
  while (Date.now() < deadline) {
    const info = (await qmpCommand(qmpSocket, "query-migrate")) as { readonly status?: unknown } | null
    const status = typeof info === "object" && info !== null ? info.status : undefined
    if (status === "completed") return
    if (status === "failed" || status === "cancelled") throw new QmpError(`migration ${String(status)}`)
    await delay(50)
  }
  throw new QmpError(`migration not completed within ${timeoutMs} ms`)
}
