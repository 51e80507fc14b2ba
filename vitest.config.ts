import { defineConfig } from "vitest/config"

export default defineConfig({
  test: {
    include: ["test/**/*.test.ts"],
    testTimeout: 60_000,
    hookTimeout: 120_000,
    // VM tests share two cores; file-level parallelism is capped so TCG guests are not starved.
    maxWorkers: 2,
    minWorkers: 1
  }
})
