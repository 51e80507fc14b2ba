import { describe, expect, it } from "@effect/vitest"
import { agentPreset } from "../src/lib/agentPresets.js"
import { BUILTIN_CATALOG, resolveModel } from "../src/lib/models.js"

describe("agent CLI presets", () => {
  it("`claude`: headless stream-json, non-essential traffic and auto-update off, permissions skipped (the VM is the sandbox)", () => {
    const preset = agentPreset(["claude"])!
    expect(preset.argv[0]).toBe("/usr/bin/env")
    expect(preset.argv).toContain("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1")
    expect(preset.argv).toContain("DISABLE_AUTOUPDATER=1")
    const cli = preset.argv.slice(preset.argv.indexOf("claude"))
    expect(cli).toEqual(["claude", "-p", "--output-format", "stream-json", "--verbose", "--dangerously-skip-permissions"])
    expect(resolveModel(BUILTIN_CATALOG, preset.defaultModel)?.provider).toBe("anthropic")
  })

  it("`codex`: exec --json with the prompt from stdin, its own sandbox off", () => {
    const preset = agentPreset(["codex"])!
    const cli = preset.argv.slice(preset.argv.indexOf("codex"))
    expect(cli.slice(0, 3)).toEqual(["codex", "exec", "--json"])
    expect(cli).toContain("--dangerously-bypass-approvals-and-sandbox")
    expect(cli.at(-1)).toBe("-")
    expect(resolveModel(BUILTIN_CATALOG, preset.defaultModel)?.provider).toBe("openai")
  })

  it("anything else is a command argv, not a preset", () => {
    expect(agentPreset(["claude", "-p"])).toBeUndefined()
    expect(agentPreset(["/usr/local/bin/claude"])).toBeUndefined()
    expect(agentPreset([])).toBeUndefined()
  })
})
