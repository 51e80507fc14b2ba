/**
 * `--agent claude` and `--agent codex`: the agent CLIs people already use, run headless in the
 * guest with JSON-line events on stdout (docs/broker.md "Agent CLIs"). A preset is only an argv:
 * the turn's text arrives on stdin (as for any `--agent` command), the turn runs as the
 * unprivileged user in /work/repo with the egress proxy, the session CA and the placeholder key
 * in its environment; `/usr/bin/env` adds the CLI's own switches that keep non-essential traffic
 * (telemetry, error reports, update checks) off. Their API traffic leaves through the broker,
 * which adds the host's key (the `anthropic` / `openai` presets, joined by the session's model).
 *
 * Both need a glibc guest with the CLI installed: the workstation image built with `--agents`
 * (images/build-full.sh).
 */

export const AGENT_PRESET_NAMES = ["claude", "codex"] as const
export type AgentPresetName = (typeof AGENT_PRESET_NAMES)[number]

export interface AgentPreset {
  readonly argv: ReadonlyArray<string>
  /** the model alias the session gets when `--model` is not given (its provider's broker rules join) */
  readonly defaultModel: string
}

const CLAUDE: AgentPreset = {
  argv: [
    "/usr/bin/env",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1",
    "DISABLE_AUTOUPDATER=1",
    "DISABLE_TELEMETRY=1",
    "DISABLE_ERROR_REPORTING=1",
    "claude",
    "-p",
    "--output-format",
    "stream-json",
    "--verbose",
    // the VM is the sandbox; refused as root, allowed as the unprivileged user turns run as
    "--dangerously-skip-permissions"
  ],
  defaultModel: "default"
}

const CODEX: AgentPreset = {
  argv: [
    "/usr/bin/env",
    "codex",
    "exec",
    "--json",
    "--skip-git-repo-check",
    // the VM is the sandbox (codex's own needs landlock/seccomp and would only get in the way)
    "--dangerously-bypass-approvals-and-sandbox",
    "-c",
    "analytics.enabled=false",
    "-c",
    "check_for_update_on_startup=false",
    // the prompt: read from stdin
    "-"
  ],
  defaultModel: "gpt"
}

/** `--agent <name>` given as one word that names a preset → the preset; otherwise undefined */
export const agentPreset = (argv: ReadonlyArray<string>): AgentPreset | undefined => {
  if (argv.length !== 1) return undefined
  switch (argv[0]) {
    case "claude":
      return CLAUDE
    case "codex":
      return CODEX
    default:
      return undefined
  }
}
