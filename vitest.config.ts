import { defineConfig } from "vitest/config"
import LongestFirst from "./test/support/longestFirst.js"

export default defineConfig({
  test: {
    include: ["test/**/*.test.ts"],
    testTimeout: 60_000,
    hookTimeout: 120_000,
    // VM tests share two cores; file-level parallelism is capped so TCG guests are not starved.
    maxWorkers: 2,
    minWorkers: 1,
    // the longest files start first (test/support/longestFirst.ts): no long file alone at the end
    sequence: { sequencer: LongestFirst }
  }
})
