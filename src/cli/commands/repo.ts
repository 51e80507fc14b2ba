import * as Args from "@effect/cli/Args"
import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as fs from "node:fs/promises"
import { withRepo } from "../../programs/detached.js"
import * as Repo from "../../programs/repo.js"
import { escapeControl } from "../../lib/text.js"
import { RepoPathInvalid } from "../../domain/repoErrors.js"
import { edge, printJson } from "../render.js"
import { json } from "./list.js"
import { sessionRef } from "./show.js"

/**
 * `abox diff`, `abox apply`, `abox cp`: the session's work out, files in. A stopped session is
 * booted for the operation and closed again (src/programs/repo.ts, `withConnection`); a session
 * another process holds fails SessionBusy.
 */

const paths = Args.text({ name: "path" }).pipe(
  Args.repeated,
  Args.withDescription("limit to these repository paths (after --)")
)

export const diffCommand = Command.make(
  "diff",
  {
    ref: sessionRef,
    stat: Options.boolean("stat").pipe(
      Options.withDescription("a summary (git diff --stat) instead of the patch")
    ),
    output: Options.file("output").pipe(
      Options.withAlias("o"),
      Options.optional,
      Options.withDescription("write the patch to this file instead of stdout")
    ),
    paths
  },
  (args) =>
    edge({ json: false })(
      Effect.gen(function* () {
        // a running session's supervisor runs it; else the session boots for it
        const patch = yield* withRepo(args.ref, (repo) => repo.diff({ stat: args.stat, paths: args.paths }))
        if (Option.isSome(args.output)) {
          const file = args.output.value
          yield* Effect.tryPromise({
            try: () => fs.writeFile(file, patch, { flag: "wx" }),
            catch: (cause) =>
              new RepoPathInvalid({ path: file, message: `cannot write ${file}: ${String(cause)}` })
          })
        } else {
          // byte for byte into a pipe or file (`abox diff | git apply`); on a terminal the guest's
          // text cannot move the cursor or rewrite lines
          yield* Effect.sync(() =>
            process.stdout.write(
              process.stdout.isTTY === true ? escapeControl(patch, { keepNewlines: true }) : patch
            )
          )
        }
      })
    )
).pipe(
  Command.withDescription(
    "the session's changes since Open as a git patch (new, modified, deleted, renamed, modes, links, binary)"
  )
)

export const applyCommand = Command.make(
  "apply",
  {
    ref: sessionRef,
    to: Options.directory("to", { exists: "yes" }).pipe(
      Options.optional,
      Options.withDescription("apply here (default: the session's recorded source)")
    ),
    check: Options.boolean("check").pipe(Options.withDescription("check only: nothing is written")),
    threeWay: Options.boolean("3way").pipe(
      Options.withDescription(
        "where the target changed since the snapshot, a three-way merge (the snapshot as base): conflicts keep markers"
      )
    ),
    json,
    paths
  },
  (args) =>
    edge({ json: args.json })(
      Effect.gen(function* () {
        const to = Option.isSome(args.to) ? args.to.value : yield* Repo.recordedSource(args.ref)
        const touched = yield* withRepo(args.ref, (repo) =>
          repo.apply({ to, check: args.check, threeWay: args.threeWay, paths: args.paths })
        )
        if (args.json) return yield* printJson({ applied: !args.check, to, paths: touched })
        yield* Console.error(
          `abox: ${args.check ? "would apply" : "applied"} ${touched.length} path(s) to ${to}` +
            (touched.length > 0 ? `:\n  ${touched.map((p) => escapeControl(p)).join("\n  ")}` : "")
        )
      })
    )
).pipe(
  Command.withDescription(
    "apply the session's changes to its source (or --to); refuses when the source changed where the patch writes"
  )
)

/** `<ref>:<path>` (the session side: no `/` before the colon) or a host path */
export const parseCpOperand = (
  operand: string
): { readonly ref: string; readonly path: string } | undefined => {
  const colon = operand.indexOf(":")
  if (colon <= 0 || operand.slice(0, colon).includes("/")) return undefined
  return { ref: operand.slice(0, colon), path: operand.slice(colon + 1) }
}

export const cpCommand = Command.make(
  "cp",
  {
    from: Args.text({ name: "from" }).pipe(Args.withDescription("<ref>:<path> or a host path")),
    to: Args.text({ name: "to" }).pipe(
      Args.withDescription(
        "a host path, or <ref>:<dir> (the host file or directory goes into that directory)"
      )
    ),
    includeGit: Options.boolean("include-git").pipe(
      Options.withDescription(
        "also copy .git directories and files out (the guest wrote them: their config and hooks run commands in git there)"
      )
    ),
    json
  },
  (args) =>
    edge({ json: args.json })(
      Effect.gen(function* () {
        const from = parseCpOperand(args.from)
        const to = parseCpOperand(args.to)
        if ((from === undefined) === (to === undefined)) {
          return yield* new RepoPathInvalid({
            path: `${args.from} ${args.to}`,
            message: "abox cp: exactly one side is <session>:<path> (e.g. abox cp proj:src/main.c ./main.c)"
          })
        }
        if (args.includeGit && from !== undefined)
          yield* Console.error(
            "abox: warning: --include-git copies the guest's .git (config, hooks): git in that directory runs commands the guest chose; read .git/config and .git/hooks before using git there"
          )
        const includeGit = args.includeGit ? { includeGit: true } : {}
        const result =
          from !== undefined
            ? yield* withRepo(from.ref, (repo) => repo.copyOut(from.path, args.to, includeGit))
            : yield* withRepo(to!.ref, (repo) => repo.copyIn(args.from, to!.path))
        if (args.json) return yield* printJson(result)
        yield* Console.error(`abox: copied ${result.files} file(s), ${result.bytes} bytes`)
      })
    )
).pipe(
  Command.withDescription(
    "copy files and directories out of a session, or into it (owned by its repository user)"
  )
)
