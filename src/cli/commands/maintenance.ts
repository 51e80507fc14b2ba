import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"
// Raw node:fs: following a growing file needs fs.watch (an event) and positional reads.
import * as fs from "node:fs"
import * as path from "node:path"
import { StringDecoder } from "node:string_decoder"
import { BROKER_LOG_FILE, streamBrokerLog } from "../../broker/log.js"
import { stripTerminalControls, terminalTextStripper } from "../../lib/terminalText.js"
import { doctor, doctorBoot } from "../../programs/doctor.js"
import { vfkitExecutable } from "../../lib/env.js"
import { sessionStatus } from "../../programs/list.js"
import { gc } from "../../programs/gc.js"
import { sessionFiles } from "../../programs/session.js"
import { SessionStore, StoreIoError } from "../../services/SessionStore.js"
import { CliExit, edge, printJson } from "../render.js"
import { json } from "./list.js"
import { sessionRef } from "./show.js"
import { SESSION_FILES, type SessionLocation } from "../../domain/sessionLayout.js"
import { escapeControl } from "../../lib/text.js"

/** done when the session stops: session.json is rewritten at Close, then the lock is free */
const untilStopped = (session: SessionLocation) =>
  Effect.gen(function* () {
    for (;;) {
      const changed = yield* Effect.acquireRelease(
        Effect.sync(() => {
          let wake = () => {}
          const happened = new Promise<void>((resolve) => (wake = resolve))
          const watcher = fs.watch(session.dir, (_event, name) => {
            if (name === SESSION_FILES.meta || name === SESSION_FILES.lock) wake()
          })
          return { watcher, happened }
        }),
        ({ watcher }) => Effect.sync(() => watcher.close())
      )
      if ((yield* sessionStatus(session)) === "stopped") return
      yield* Effect.promise(() => changed.happened)
      // the lock is released just after the close is recorded, and a release makes no file event:
      // look again a few times, briefly
      for (let i = 0; i < 20; i++) {
        if ((yield* sessionStatus(session)) === "stopped") return
        yield* Effect.sleep("100 millis")
      }
    }
  }).pipe(Effect.scoped)

/** the bytes of `file` from `offset` on, then every append as it happens (fs.watch, no polling loop) */
const follow = (file: string) =>
  Stream.asyncPush<Uint8Array>((emit) =>
    Effect.acquireRelease(
      Effect.sync(() => {
        let offset = 0
        let reading = false
        const drain = () => {
          if (reading) return
          reading = true
          try {
            const size = fs.existsSync(file) ? fs.statSync(file).size : 0
            if (size < offset) offset = 0 // truncated (console.log keeps its tail): start over
            if (size > offset) {
              const fd = fs.openSync(file, "r")
              try {
                const chunk = Buffer.alloc(size - offset)
                fs.readSync(fd, chunk, 0, chunk.length, offset)
                offset = size
                emit.single(chunk)
              } finally {
                fs.closeSync(fd)
              }
            }
          } finally {
            reading = false
          }
        }
        drain()
        const watcher = fs.watch(path.dirname(file), (_event, name) => {
          if (name === path.basename(file)) drain()
        })
        return watcher
      }),
      (watcher) => Effect.sync(() => watcher.close())
    )
  )

export const logs = Command.make(
  "logs",
  {
    ref: sessionRef,
    follow: Options.boolean("follow").pipe(
      Options.withAlias("f"),
      Options.withDescription("keep printing as the log grows")
    ),
    raw: Options.boolean("raw").pipe(
      Options.withDescription("the console as the guest wrote it, terminal control sequences included")
    ),
    broker: Options.boolean("broker").pipe(
      Options.withDescription("the HTTPS broker's decisions instead of the guest console")
    )
  },
  (args) =>
    edge({ json: false })(
      Effect.gen(function* () {
        const store = yield* SessionStore
        const session = yield* store.locate(args.ref)
        const { id, dir } = session
        if (args.broker) {
          // streamed (the log may be large) and escaped (host names are the guest's choice)
          const logFile = path.join(dir, BROKER_LOG_FILE)
          const printed = yield* streamBrokerLog(logFile).pipe(
            Stream.runFoldEffect(0, (n, line) => Effect.as(Console.log(line), n + 1)),
            Effect.mapError(
              (error) => new StoreIoError({ path: logFile, operation: "read", message: error.message })
            )
          )
          if (printed === 0) yield* Console.log("(no broker decisions yet)")
          return
        }
        const file = sessionFiles(dir).consoleLog
        if (!args.follow) {
          if (!fs.existsSync(file))
            return yield* Console.error(`abox: ${escapeControl(id)} has no console log yet (never booted)`)
          const bytes = yield* Effect.try({
            try: () => fs.readFileSync(file),
            catch: (cause) =>
              new StoreIoError({
                path: file,
                operation: "read",
                message: `cannot read ${file}: ${String(cause)}`
              })
          })
          yield* Effect.sync(() =>
            process.stdout.write(args.raw ? bytes : stripTerminalControls(bytes.toString("utf8")))
          )
          return
        }
        const decoder = new StringDecoder("utf8")
        const stripper = terminalTextStripper()
        const write = (chunk: Uint8Array) =>
          Effect.sync(() =>
            process.stdout.write(args.raw ? chunk : stripper.push(decoder.write(Buffer.from(chunk))))
          )
        if ((yield* sessionStatus(session)) === "stopped") {
          // nothing more will be written: print what is there and end
          yield* follow(file).pipe(Stream.take(1), Stream.runForEach(write))
          return yield* Console.error(
            `abox: ${id} is not running: nothing more will come (logs -f follows a running session)`
          )
        }
        yield* follow(file).pipe(Stream.runForEach(write), Effect.raceFirst(untilStopped(session)))
      })
    )
).pipe(
  Command.withDescription(
    "print a session's guest console (console.log), or its broker log. Example: abox logs proj -f"
  )
)

export const gcCommand = Command.make(
  "gc",
  {
    dryRun: Options.boolean("dry-run").pipe(
      Options.withDescription("show what would be cleaned, change nothing")
    ),
    json
  },
  (args) =>
    edge({ json: args.json })(
      Effect.gen(function* () {
        const actions = yield* gc({ dryRun: args.dryRun })
        if (args.json) return yield* printJson({ dryRun: args.dryRun, actions })
        if (actions.length === 0) return yield* Console.log("nothing to clean")
        const verb = args.dryRun ? "would remove" : "removed"
        for (const a of actions) {
          yield* Console.log(
            `${a.kind === "orphan-vmm" ? (args.dryRun ? "would stop" : "stopped") : verb} ${a.kind} ${a.target}: ${a.detail}`
          )
        }
      })
    )
).pipe(
  Command.withDescription(
    "clean what a crash left: stale sockets, temp files, names of missing sessions, VMs whose session is gone (never a session). Example: abox gc --dry-run"
  )
)

const boot = Options.boolean("boot").pipe(
  Options.withDescription(
    "also boot a throwaway VM of the default image and report each step: VMM (vfkit found and signed), kernel format, disk alignment, hello, entropy, console"
  )
)

export const doctorCommand = Command.make("doctor", { json, boot }, (args) =>
  edge({ json: args.json })(
    Effect.gen(function* () {
      const checks = [
        ...(yield* doctor()),
        ...(args.boot ? yield* doctorBoot({ vfkit: yield* vfkitExecutable }) : [])
      ]
      if (args.json) yield* printJson({ checks })
      else {
        const mark = { ok: "ok  ", warn: "warn", fail: "FAIL" } as const
        yield* Console.log(checks.map((c) => `${mark[c.status]}  ${c.name.padEnd(9)} ${c.detail}`).join("\n"))
      }
      if (checks.some((c) => c.status === "fail")) return yield* new CliExit({ code: 1, tag: "DoctorFailed" })
    })
  )
).pipe(
  Command.withDescription(
    "check this host: VMM and accelerator, default image, broker policy, free space, secret scrubber; --boot boots a throwaway VM too. Example: abox doctor --boot"
  )
)
