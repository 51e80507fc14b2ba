import * as Args from "@effect/cli/Args"
import * as Command from "@effect/cli/Command"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import { diskUsage, formatBytes } from "../../lib/diskUsage.js"
import { describeRootDisk, sharedBytesSync } from "../../lib/rootDisk.js"
import { sessionStatus } from "../../programs/list.js"
import { savedStateBytes } from "../../programs/suspend.js"
import { AboxPaths } from "../../services/AboxPaths.js"
import { SessionStore, type SessionMeta } from "../../services/SessionStore.js"
import { edge, notAnOption, printJson } from "../render.js"
import { json } from "./list.js"
import { escapeControl } from "../../lib/text.js"

/** the broker policy in one line: what may be reached, and which hosts get a credential (by name, never a value) */
const describePolicy = (policy: NonNullable<SessionMeta["policy"]>): string => {
  if (policy.allow.length === 0) return "deny all"
  const allow = policy.allow.map((rule) => `${rule.host}:${rule.ports.join(",")}`).join(" ")
  const credentials = policy.credentials.map(
    (rule) => `${rule.host} ${rule.header} from ${"fromEnv" in rule ? `$${rule.fromEnv}` : rule.fromFile}`
  )
  return `allow ${allow}${credentials.length > 0 ? `; credentials: ${credentials.join(", ")}` : ""}`
}

export const sessionRef = notAnOption(Args.text({ name: "id|name" })).pipe(
  Args.withDescription("a session id or a session name")
)

export const show = Command.make("show", { ref: sessionRef, json }, (args) =>
  edge({ json: args.json })(
    Effect.gen(function* () {
      const store = yield* SessionStore
      const session = yield* store.locate(args.ref)
      const { id, dir, legacy } = session
      const meta = yield* store.get(id)
      const names = (yield* store.listNames()).filter((b) => b.sessionId === id).map((b) => b.name)
      const status = yield* sessionStatus(session)
      const bytes = yield* diskUsage(dir)
      const paths = yield* AboxPaths
      const sharedBytes = sharedBytesSync(paths.images, meta.image, meta.rootDisk)
      const running = status === "running"
      // a suspended session: its saved memory state's size on disk
      const memoryStateBytes = savedStateBytes(dir)
      if (args.json)
        return yield* printJson({
          session: {
            id,
            dir,
            legacy,
            names,
            running,
            bytes,
            sharedBytes,
            ...(memoryStateBytes === undefined ? {} : { memoryStateBytes }),
            rootDisk: describeRootDisk(meta.rootDisk),
            meta
          }
        })
      const lines: Array<[string, string | undefined]> = [
        ["id", id],
        ["status", running ? "RUNNING" : memoryStateBytes !== undefined ? "SUSPENDED" : "STOPPED"],
        [
          "memory",
          memoryStateBytes === undefined ? undefined : `${formatBytes(memoryStateBytes)} saved state`
        ],
        [
          "disk",
          formatBytes(bytes) +
            (sharedBytes > 0 ? ` own, ${formatBytes(sharedBytes)} shared with its image` : "")
        ],
        ["root disk", describeRootDisk(meta.rootDisk)],
        ["names", names.join(", ") || undefined],
        ["dir", dir + (legacy ? " (legacy home: read-only)" : "")],
        ["created", meta.created],
        ["source", meta.source],
        ["model", meta.model],
        ["image", meta.image ? `${meta.image.name}@${meta.image.digest}` : undefined],
        ["guest", meta.guest ? `${meta.guest.arch}, protocol ${meta.guest.protocol}` : "(not recorded)"],
        ["vmm", meta.vmm?.backend ?? "(not recorded)"],
        [
          "resources",
          meta.resources ? `${meta.resources.cpus} cpus, ${meta.resources.memoryMiB} MiB` : undefined
        ],
        // a running session's last close is history, not its state
        [
          running ? "prev close" : "last close",
          meta.lastClose ? `${meta.lastClose.how} at ${meta.lastClose.at}` : undefined
        ],
        ["broker", meta.policy ? describePolicy(meta.policy) : "(no policy recorded: deny all)"]
      ]
      yield* Console.log(
        lines
          .flatMap(([k, v]) => (v === undefined ? [] : [`${(k + ":").padEnd(11)} ${escapeControl(v)}`]))
          .join("\n")
      )
    })
  )
).pipe(
  Command.withDescription(
    "show one session's metadata, status and disk usage. Example: abox show proj --json"
  )
)
