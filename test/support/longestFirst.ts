/**
 * The order vitest starts test files in: the longest first, so that the run does not end with one
 * long VM file alone on one worker while the other is idle (maxWorkers is 2). The weights are the
 * files' seconds in a whole run on a 2-core host with QEMU under TCG; a file not listed runs after
 * these in vitest's own order (its cached durations, else larger files first). Vitest's cache
 * alone is not enough: it is empty on a fresh checkout, and a run that built an image charges the
 * build to whichever file waited for it.
 */
import * as path from "node:path"
import { BaseSequencer, type TestSpecification } from "vitest/node"

/** seconds per file (test/ relative), the longest first */
export const fileSeconds: Readonly<Record<string, number>> = {
  "e2e-fork-vm.test.ts": 225,
  "e2e-agent-vm.test.ts": 144,
  "e2e-workstation-vm.test.ts": 133,
  "e2e-cli.test.ts": 98,
  "e2e-suspend-vm.test.ts": 92,
  "e2e-environment-vm.test.ts": 149,
  "e2e-agent-clis-vm.test.ts": 66,
  "e2e-broker-vm.test.ts": 54,
  "e2e-export-vm.test.ts": 51,
  "e2e-broker-local-vm.test.ts": 49,
  "e2e-oci-vm.test.ts": 44,
  "e2e-guestroot-vm.test.ts": 44,
  "e2e-detached-wire.test.ts": 43,
  "image-reproducible.test.ts": 42,
  "e2e-detached.test.ts": 100,
  "e2e-cow-vm.test.ts": 39,
  "e2e-warm-vm.test.ts": 59,
  "supervisor.test.ts": 39,
  "cli.detached.test.ts": 34,
  "agent.cli.test.ts": 29,
  "e2e-repo-vm.test.ts": 25,
  "e2e-vm.test.ts": 25,
  "broker-e2e.test.ts": 20,
  "oci-import.test.ts": 19,
  "vmm-liveness.test.ts": 18,
  "darwin.test.ts": 18,
  "qemu-close.test.ts": 18
}

const testDir = path.resolve(import.meta.dirname, "..")

const weightOf = (spec: TestSpecification): number =>
  fileSeconds[path.relative(testDir, spec.moduleId).split(path.sep).join("/")] ?? 0

export default class LongestFirst extends BaseSequencer {
  override async sort(files: Array<TestSpecification>): Promise<Array<TestSpecification>> {
    const rest = await super.sort(files)
    // a stable sort: files of equal weight (every unlisted one) keep vitest's order
    return rest
      .map((spec, index) => ({ spec, index, weight: weightOf(spec) }))
      .sort((a, b) => b.weight - a.weight || a.index - b.index)
      .map(({ spec }) => spec)
  }
}
