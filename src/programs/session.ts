import type { CommandExecutor } from "@effect/platform/CommandExecutor"
import * as Clock from "effect/Clock"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as ExecutionStrategy from "effect/ExecutionStrategy"
import * as Exit from "effect/Exit"
import * as Option from "effect/Option"
import * as Ref from "effect/Ref"
import * as Scope from "effect/Scope"
import * as Stream from "effect/Stream"
import * as Schema from "effect/Schema"
import * as fs from "node:fs/promises"
import * as os from "node:os"
import * as path from "node:path"
import { writeConfigDisk } from "../lib/disk.js"
import { buildRepoDisks, existingRepoDisks, removeRepoDisks, repoDiskTools } from "../lib/repoDisk.js"
import { checkOverlay, copyWarmRoot, sessionRootDisk, standaloneKernel } from "../lib/rootDisk.js"
import { settleDisks } from "../lib/frozenLayers.js"
import { warmSnapshotFor } from "./warm.js"
import { stripTerminalControls } from "../lib/terminalText.js"
import { earlyExitReport } from "../vmm/console.js"
import { snapshotSource } from "../lib/snapshot.js"
import { ensureSocketDir, rpcSocketPath } from "../lib/socketPath.js"
import { sessionFile, type SessionLocation } from "../domain/sessionLayout.js"
import { GUEST_CONFIG_FORMAT, type GuestConfig, type ModelSpec } from "../protocol/GuestConfig.js"
import { TurnLimits, type HelloMessage } from "../protocol/Messages.js"
import {
  GuestDisconnected,
  GuestRpc,
  type GuestConnection,
  type TurnEvent,
  type GuestRpcError,
  type TtyRequest,
  type TtyUnsupported
} from "../services/GuestRpc.js"
import { FEATURE_LIMITS, FEATURE_TTY } from "../protocol/Messages.js"
import { AboxPaths } from "../services/AboxPaths.js"
import { HttpsBroker, type BrokerSession } from "../services/HttpsBroker.js"
import { Images } from "../services/Images.js"
import { type GoldenImage } from "../domain/image.js"
import { RuntimeLock, type HeldLock } from "../services/RuntimeLock.js"
import { SessionStore, StoreIoError, type SessionMeta } from "../services/SessionStore.js"
import { VmmBackend } from "../services/VmmBackend.js"
import {
  VmmError,
  type CloseBounds,
  type RepoDisks,
  type VmExit,
  type VmHandle,
  type VmSpec
} from "../domain/vm.js"
import type { StateManifest } from "../domain/memoryState.js"
import {
  freezeVm,
  type FreezeError,
  type Frozen,
  restoreSaved,
  suspendVm,
  SuspendRefused,
  type SuspendError
} from "./suspend.js"
import { hostArch } from "../lib/arch.js"
import { type BrokerPolicy, withRules } from "../broker/policy.js"
import {
  brokerRulesFor,
  localModelRoute,
  mergeCatalog,
  ModelCatalogError,
  resolveModel,
  type ModelCatalog
} from "../lib/models.js"
import * as Config from "effect/Config"
import * as Either from "effect/Either"
import { checkCompatibility } from "./compat.js"
import { EnvironmentInstallFailed } from "../domain/environment.js"

/** A running session: the VM is up, the guest said hello. Closing its scope is Close. */
export interface Session {
  readonly id: string
  readonly dir: string
  readonly meta: SessionMeta
  readonly hello: HelloMessage
  readonly connection: GuestConnection
  /**
   * one turn: the guest's events as they come, ending with `End`; interrupting it cancels the
   * turn. `mode`: "shell" (default) runs a command, "prompt" asks the model agent.
   */
  readonly turn: (
    text: string,
    mode?: TurnMode,
    limits?: TurnLimits
  ) => Stream.Stream<TurnEvent, GuestRpcError>
  /** one shell command on a pseudo-terminal in the guest (GuestConnection.ttyTurn) */
  readonly ttyTurn: (
    text: string,
    request: TtyRequest
  ) => Stream.Stream<TurnEvent, TtyUnsupported | GuestRpcError>
  /** the model the session's prompt turns use (resolved from the catalog at boot), if any */
  readonly modelSpec?: ModelSpec | undefined
  /** source entries the snapshot left out (sockets, fifos, devices); empty on resume */
  readonly skipped: ReadonlyArray<string>
  /**
   * save the VM's memory beside its disks and end the VM (no turn may run): the next
   * resume restores it, processes and all. Close the session's scope afterwards, as ever.
   */
  readonly suspend: Effect.Effect<StateManifest, SuspendError>
  /**
   * a fork's first half (src/programs/fork.ts; no turn may run): the disks become frozen layers,
   * the VM goes on in new overlays over them, its memory saved into `statePath` meanwhile
   */
  readonly freeze: (statePath: string) => Effect.Effect<Frozen, FreezeError, CommandExecutor>
  /** this boot restored a saved memory state (false: a cold boot) */
  readonly restored: boolean
  /**
   * completes if the VM ends by itself (killed, crashed, powered off from inside); never for the
   * end a suspend asks for. A session host watches it so it does not outlive its VM
   */
  readonly vmEnded: Effect.Effect<VmExit>
}

export type TurnMode = "shell" | "prompt"

export interface BootOptions {
  readonly model?: string | undefined
  readonly cpus?: number | undefined
  readonly memoryMiB?: number | undefined
  readonly bounds?: Partial<CloseBounds> | undefined
  readonly helloTimeout?: Duration.DurationInput | undefined
  readonly shutdownTimeout?: Duration.DurationInput | undefined
  /** argv of an agent command that prints JSON lines (default: the turn runs as a shell command) */
  readonly agent?: ReadonlyArray<string> | undefined
  /** test images only: the guest ignores shutdown, so Close takes the bounded kill path */
  readonly ignoreShutdown?: boolean | undefined
  /**
   * the HTTPS broker's policy (docs/broker.md); default: the one recorded for the session, else
   * `$ABOX_HOME/broker.json` if it exists, else deny everything
   */
  readonly policy?: BrokerPolicy | undefined
  /**
   * told as each phase of Open/Resume begins (the CLI's step display; SDK users get the same
   * phases): an Effect to run, or a plain callback (the Promise facade)
   */
  readonly onPhase?: ((phase: Phase) => Effect.Effect<void> | void) | undefined
  /** told as the snapshot moves into the session (the CLI's progress bar) */
  readonly onProgress?: ((progress: TransferProgress) => Effect.Effect<void>) | undefined
  /**
   * Open only: restore the image's warm snapshot instead of booting (default true; also
   * `ABOX_WARM=0`); where it cannot be used, Open boots and says why at debug level
   */
  readonly warm?: boolean | undefined
  /** variables for turn processes (the repository's environment; docs/environments.md) */
  readonly env?: Readonly<Record<string, string>> | undefined
  /**
   * an environment's setup VM: turns run as root, the repository is read-only, no conversation
   * is kept, and the model's provider rules stay out of the broker's policy (no credential the
   * user did not grant reaches the setup)
   */
  readonly setup?: boolean | undefined
}

/** how far a transfer is: bytes (and files, where known) of the totals */
export interface TransferProgress {
  readonly files: number
  readonly bytes: number
  readonly totalFiles: number
  readonly totalBytes: number
}

export type Phase = "snapshot" | "environment" | "clone" | "config" | "boot" | "transfer" | "install" | "ready"

const phase = (options: BootOptions, name: Phase): Effect.Effect<void> =>
  Effect.suspend(() => {
    const told = options.onPhase?.(name)
    // at debug level: the phases' timestamps are Open's profile
    return Effect.zipRight(Effect.logDebug(`phase: ${name}`), Effect.isEffect(told) ? told : Effect.void)
  })

export interface OpenOptions extends BootOptions {
  readonly source: string
  readonly name?: string | undefined
  readonly image?: string | undefined
  /**
   * a shell command run as the repository user once the repository is in (the environment's
   * `install`); a non-zero status fails the Open (EnvironmentInstallFailed), nothing is kept
   */
  readonly install?: string | undefined
  /** told each chunk of the install command's output */
  readonly onInstallOutput?: ((event: TurnEvent) => Effect.Effect<void>) | undefined
}

export const DEFAULT_MODEL = "default"
export const DEFAULT_CPUS = 2
export const DEFAULT_MEMORY_MIB = 1024
export const DEFAULT_BOUNDS: CloseBounds = {
  graceful: "15 seconds",
  signalled: "5 seconds",
  killed: "5 seconds"
}
/** generous: under TCG on a loaded machine a boot can take many times its usual 4 s */
export const DEFAULT_HELLO_TIMEOUT = Duration.minutes(3)
export const DEFAULT_SHUTDOWN_TIMEOUT = Duration.seconds(10)

export const GUEST_REPO = "/work/repo"

/** a boot option outside what a VM can run with (checked before anything is made) */
export class InvalidOption extends Schema.TaggedError<InvalidOption>()("InvalidOption", {
  option: Schema.String,
  message: Schema.String
}) {}

export const MIN_MEMORY_MIB = 256
export const MAX_CPUS = 64

/** --cpus and --memory in range: the guest kernel does not boot below 256 MiB, nor past the host's memory */
const checkResources = (options: BootOptions) =>
  Effect.gen(function* () {
    const { cpus, memoryMiB } = options
    if (cpus !== undefined && !(Number.isInteger(cpus) && cpus >= 1 && cpus <= MAX_CPUS)) {
      return yield* new InvalidOption({
        option: "cpus",
        message: `--cpus ${cpus}: a VM gets 1 to ${MAX_CPUS} CPUs`
      })
    }
    const hostMiB = Math.floor(os.totalmem() / 1024 / 1024)
    if (
      memoryMiB !== undefined &&
      !(Number.isInteger(memoryMiB) && memoryMiB >= MIN_MEMORY_MIB && memoryMiB <= hostMiB)
    ) {
      return yield* new InvalidOption({
        option: "memory",
        message: `--memory ${memoryMiB}: a VM gets ${MIN_MEMORY_MIB} to ${hostMiB} MiB (this host's memory)`
      })
    }
  })

export const sessionFiles = (dir: string) => ({
  configDisk: sessionFile(dir, "configDisk"),
  consoleLog: sessionFile(dir, "consoleLog"),
  // <dir>/rpc.sock, or a short path where that is too long for a unix socket (macOS: 104 bytes)
  rpcSocket: rpcSocketPath(dir)
})

const storeIo = (file: string, operation: string) => (error: { readonly message: string }) =>
  new StoreIoError({ path: file, operation, message: `${operation} ${file}: ${error.message}` })

/** config.raw (the sealed disk the guest reads) and guest-config.json (the host's copy): one content, secretless. */
const writeConfig = Effect.fn("session.writeConfig")(function* (
  id: string,
  dir: string,
  config: GuestConfig
) {
  const store = yield* SessionStore
  yield* writeConfigDisk(sessionFiles(dir).configDisk, config)
  yield* store.writeGuestConfig(id, config)
})

/** the broker denies every tunnel */
export const DENY_ALL: BrokerPolicy = { format: 1, allow: [], credentials: [], resolve: {} }

/** `$ABOX_HOME/broker.json` when the user wrote one, else deny everything */
export const defaultPolicy = Effect.gen(function* () {
  const paths = yield* AboxPaths
  const broker = yield* HttpsBroker
  const file = paths.homeFile("brokerPolicy")
  const present = yield* Effect.promise(() =>
    fs.access(file).then(
      () => true,
      () => false
    )
  )
  return present ? yield* broker.loadPolicy(file) : DENY_ALL
})

/** the model catalog: built in, overridden by `$ABOX_HOME/models.json` (docs/on-disk.md) */
export const loadModelCatalog = Effect.gen(function* () {
  const paths = yield* AboxPaths
  const file = paths.homeFile("modelCatalog")
  const text = yield* Effect.tryPromise({
    try: () =>
      fs.readFile(file, "utf8").catch((error: NodeJS.ErrnoException) => {
        if (error.code === "ENOENT") return undefined
        throw error
      }),
    catch: (error) => new ModelCatalogError({ path: file, message: `cannot read ${file}: ${String(error)}` })
  })
  const merged = mergeCatalog(text)
  if (Either.isLeft(merged)) {
    return yield* new ModelCatalogError({
      path: file,
      message: `${file} is not a valid model catalog: ${merged.left}`
    })
  }
  return merged.right satisfies ModelCatalog
})

/**
 * The session's model and the policy the broker enforces for this boot: the provider's rules
 * (its preset) join the policy when the host has the model's key variable set, so a key in the
 * environment is all it takes. Not recorded in session.json: each boot derives them again.
 */
const modelAndPolicy = Effect.fn("session.modelAndPolicy")(function* (alias: string, policy: BrokerPolicy) {
  const spec = resolveModel(yield* loadModelCatalog, alias)
  // a keyless server on the host's loopback: that endpoint alone, under a name of its own
  const local = spec === undefined ? undefined : localModelRoute(spec)
  if (local !== undefined)
    return { spec: local.spec, policy: { ...policy, localHttp: [...(policy.localHttp ?? []), local.rule] } }
  if (spec?.hostVariable === undefined) return { spec, policy }
  const key = yield* Config.option(Config.redacted(spec.hostVariable)).pipe(
    Effect.orElseSucceed(() => Option.none())
  )
  return { spec, policy: Option.isSome(key) ? withRules(policy, brokerRulesFor(spec)) : policy }
})

const guestConfigFor = (
  id: string,
  options: BootOptions,
  policy: BrokerPolicy,
  broker: Pick<BrokerSession, "caCertPem" | "guestCaPems">,
  modelSpec: ModelSpec | undefined
): GuestConfig => ({
  format: GUEST_CONFIG_FORMAT,
  sessionId: id,
  model: options.model ?? DEFAULT_MODEL,
  ...(modelSpec === undefined ? {} : { modelSpec }),
  brokerCaCert: broker.caCertPem,
  ...(broker.guestCaPems.length === 0 ? {} : { extraCaCerts: [...broker.guestCaPems] }),
  // the agent's processes see these names with a placeholder; the broker adds the real value
  placeholderEnv: [
    ...new Set(
      policy.credentials.flatMap((rule) =>
        "fromEnv" in rule && rule.fromEnv !== undefined ? [rule.fromEnv] : []
      )
    )
  ],
  ...(options.agent !== undefined ? { agent: { argv: [...options.agent] } } : {}),
  ...(options.env !== undefined && Object.keys(options.env).length > 0 ? { env: { ...options.env } } : {}),
  ...(options.setup === true ? { setup: true } : {}),
  ...(options.ignoreShutdown === true ? { ignoreShutdown: true } : {})
})

/**
 * The part Open and Resume share: config → listen on rpc.sock → start the VM → the guest's
 * hello. Finalizers run in reverse: shutdown RPC (the connection) → the VMM's bounded stop →
 * the close outcome into session.json → (the caller's) unlock.
 */
const boot = Effect.fn("session.boot")(function* (
  meta: SessionMeta,
  /** the session directory (SessionStore located it) */
  dir: string,
  image: Pick<GoldenImage, "kernel" | "initrd" | "arch">,
  lock: HeldLock,
  options: BootOptions,
  recordedPolicy: BrokerPolicy,
  repoDisks: RepoDisks | undefined,
  /** restore this warm state instead of booting; the config goes as the first message */
  warm?: { readonly state: string; readonly manifest: StateManifest } | undefined
) {
  const store = yield* SessionStore
  const vmm = yield* VmmBackend
  const rpc = yield* GuestRpc
  const httpsBroker = yield* HttpsBroker
  const files = sessionFiles(dir)
  const root = sessionRootDisk(dir, meta.rootDisk)

  yield* phase(options, "config")
  const model =
    options.setup === true
      ? { spec: undefined, policy: recordedPolicy }
      : yield* modelAndPolicy(options.model ?? DEFAULT_MODEL, recordedPolicy)
  const policy = model.policy
  // a new CA every boot: its key lives in this process's memory only, its certificate goes to the guest
  const broker = yield* httpsBroker.make(policy, { sessionId: meta.id, sessionDir: dir })
  const config = guestConfigFor(meta.id, options, policy, broker, model.spec)
  // written for a warm session too: its resume boots from the disk
  yield* writeConfig(meta.id, dir, config)

  const vmRef = yield* Ref.make(Option.none<VmHandle>())
  yield* Effect.addFinalizer(() =>
    Ref.get(vmRef).pipe(
      Effect.flatMap(
        Option.match({
          onNone: () => Effect.void,
          onSome: (vm) =>
            vm.outcome.pipe(
              Effect.flatMap((outcome) =>
                store.update(meta.id, (current) => ({ ...current, lastClose: outcome }))
              ),
              Effect.ignore,
              // the VM is down: overlays it went on in after a fork become its disks' own names
              Effect.zipRight(Effect.ignore(settleDisks(dir)))
            )
        })
      )
    )
  )

  yield* phase(options, "boot")
  if (files.rpcSocket !== sessionFile(dir, "rpcSocket") && meta.rpcSocket !== files.rpcSocket) {
    yield* store.update(meta.id, (current) => ({ ...current, rpcSocket: files.rpcSocket }))
  }
  yield* ensureSocketDir(files.rpcSocket).pipe(
    Effect.mapError(storeIo(files.rpcSocket, "prepare socket directory"))
  )
  const listener = yield* rpc.listen(files.rpcSocket, {
    helloTimeout: options.helloTimeout ?? DEFAULT_HELLO_TIMEOUT,
    shutdownTimeout: options.shutdownTimeout ?? DEFAULT_SHUTDOWN_TIMEOUT,
    ...(warm === undefined ? {} : { handoff: { config, repoDisks: repoDisks !== undefined } })
  })
  const spec: VmSpec = {
    sessionId: meta.id,
    sessionDir: dir,
    arch: image.arch,
    kernel: image.kernel,
    initrd: image.initrd,
    rootDisk: root.file,
    rootDiskFormat: root.format,
    configDisk: files.configDisk,
    rpcSocket: files.rpcSocket,
    consoleLog: files.consoleLog,
    cpus: options.cpus ?? meta.resources?.cpus ?? DEFAULT_CPUS,
    memoryMiB: options.memoryMiB ?? meta.resources?.memoryMiB ?? DEFAULT_MEMORY_MIB,
    lockFd: lock.fd,
    bounds: { ...DEFAULT_BOUNDS, ...options.bounds },
    ...(repoDisks === undefined ? {} : { repoDisks }),
    ...(warm === undefined ? {} : { warm: true })
  }
  // a warm open: the image's warm state in the warm layout (the repository disks plugged in
  // after the load); else a suspended session's saved memory when it still fits (else a cold
  // boot, said why)
  const restored =
    warm === undefined
      ? yield* restoreSaved(vmm, spec, meta.image?.digest ?? "", (message) => Effect.logWarning(message))
      : Option.none<VmHandle>()
  const vm =
    warm !== undefined && vmm.restore !== undefined
      ? yield* vmm.restore(spec, {
          statePath: warm.state,
          manifest: warm.manifest,
          imageDigest: meta.image?.digest ?? ""
        })
      : Option.isSome(restored)
        ? restored.value
        : yield* vmm.start(spec)
  yield* Ref.set(vmRef, Option.some(vm))

  // A VM that dies before its hello is reported at once, not after the hello timeout.
  // The last lines of its console and of the VMM's own log (vfkit.log) go into the message: a
  // failed Open removes the session directory and both logs with it.
  const died = vm.exited.pipe(
    Effect.flatMap((exit) =>
      Effect.flatMap(
        Effect.sync(() =>
          earlyExitReport(files.consoleLog, vm.vmmLog, (line) => stripTerminalControls(line).slice(0, 200))
        ),
        (report) =>
          Effect.fail(
            new GuestDisconnected({
              message: `the VM exited before the guest said hello (exit ${exit.exitCode ?? exit.signal}); ${report}`
            })
          )
      )
    )
  )
  const connection = yield* Effect.raceFirst(
    // a restored guest trusts the CA it booted with until it hears this process's own
    Option.isSome(restored) ? listener.acceptResumed({ brokerCaCert: broker.caCertPem }) : listener.accept,
    died
  )
  yield* Effect.forkScoped(broker.serve(connection.tunnels))
  return { connection, broker, modelSpec: model.spec, vm, restored: Option.isSome(restored) }
})

/**
 * Why a turn's limits cannot be honoured in this session, or undefined: limits are for prompt
 * turns; a guest that predates them (no FEATURE_LIMITS) would ignore them; a spending limit needs
 * the model's prices in the catalog.
 */
export const turnLimitsProblem = (
  hello: HelloMessage,
  spec: ModelSpec | undefined,
  mode: TurnMode | undefined,
  limits: TurnLimits | undefined
): { readonly option: string; readonly message: string } | undefined => {
  if (limits === undefined || (limits.maxSteps === undefined && limits.maxCostUsd === undefined))
    return undefined
  const option = limits.maxCostUsd !== undefined ? "max-cost" : "max-steps"
  if (!Schema.is(TurnLimits)(limits)) {
    return {
      option,
      message: "max steps must be a whole number from 1 to 1000, max cost a positive number of US dollars"
    }
  }
  if (mode !== "prompt")
    return { option, message: `--${option} is for prompt turns (--prompt), not shell commands` }
  if (hello.features?.includes(FEATURE_LIMITS) !== true) {
    return {
      option,
      message: `this session's guest predates per-turn limits (--max-steps, --max-cost): run image-update and open a new session`
    }
  }
  if (limits.maxCostUsd !== undefined && (spec?.inputPrice === undefined || spec.outputPrice === undefined)) {
    return {
      option,
      message: `--max-cost needs the model's prices, and the model catalog has none for ${spec?.id ?? "this session's model"}: set inputPrice and outputPrice (US dollars per million tokens) in its models.json entry (docs/on-disk.md)`
    }
  }
  return undefined
}

const sessionFrom = (
  meta: SessionMeta,
  dir: string,
  booted: {
    readonly connection: GuestConnection
    readonly broker: BrokerSession
    readonly modelSpec?: ModelSpec | undefined
    readonly vm: VmHandle
    readonly restored: boolean
  },
  skipped: ReadonlyArray<string>
): Session => {
  const { connection, broker } = booted
  // turns are numbered after the ones the guest remembers, so broker.log lines up with context.json
  let turns = connection.hello.contextTurns ?? 0
  // turns running now: a suspend waits for none
  let running = 0
  // a suspend ends the VM on purpose
  let suspending = false
  const counted = <A, E, R>(stream: Stream.Stream<A, E, R>) =>
    Stream.ensuring(
      Stream.unwrap(Effect.sync(() => (running += 1)).pipe(Effect.as(stream))),
      Effect.sync(() => (running -= 1))
    )
  return {
    id: meta.id,
    dir,
    meta,
    hello: connection.hello,
    connection,
    turn: (text, mode, limits) => {
      // limits that cannot be honoured end the turn at once, as the agent ends one (every client
      // path prints or returns its agent_end); nothing is sent to the guest
      const problem = turnLimitsProblem(connection.hello, booted.modelSpec, mode, limits)
      if (problem !== undefined) {
        return Stream.make<Array<TurnEvent>>(
          {
            _tag: "Event",
            event: { kind: "agent_end", reason: "error", steps: 0, message: problem.message }
          },
          { _tag: "End", exitCode: 1, signal: null, cancelled: false }
        )
      }
      return Stream.unwrapScoped(
        Effect.acquireRelease(
          Effect.suspend(() => broker.setTurn(++turns)),
          () => broker.setTurn(undefined)
        ).pipe(Effect.as(counted(connection.turn(text, mode, limits))))
      ).pipe(Stream.withSpan("Session.turn", { attributes: { session: meta.id, mode: mode ?? "shell" } }))
    },
    ttyTurn: (text, request) =>
      // a guest without tty turns refuses before a turn number is taken
      connection.hello.features?.includes(FEATURE_TTY) !== true
        ? connection.ttyTurn(text, request)
        : Stream.unwrapScoped(
            Effect.acquireRelease(
              Effect.suspend(() => broker.setTurn(++turns)),
              () => broker.setTurn(undefined)
            ).pipe(Effect.as(counted(connection.ttyTurn(text, request))))
          ).pipe(Stream.withSpan("Session.ttyTurn", { attributes: { session: meta.id } })),
    modelSpec: booted.modelSpec,
    skipped,
    suspend: Effect.suspend(() =>
      running > 0
        ? Effect.fail(
            new SuspendRefused({ reason: "busy", message: "a turn is running: suspend once it has ended" })
          )
        : Effect.sync(() => (suspending = true)).pipe(
            Effect.zipRight(suspendVm(booted.vm, connection.hello, dir, meta.image?.digest ?? "")),
            Effect.onError(() => Effect.sync(() => (suspending = false)))
          )
    ),
    freeze: (statePath) =>
      Effect.suspend(() =>
        running > 0
          ? Effect.fail(
              new SuspendRefused({ reason: "busy", message: "a turn is running: fork once it has ended" })
            )
          : freezeVm(booted.vm, connection.hello, dir, meta.image?.digest ?? "", statePath)
      ),
    restored: booted.restored,
    vmEnded: booted.vm.exited.pipe(Effect.flatMap((exit) => (suspending ? Effect.never : Effect.succeed(exit))))
  }
}

/** a restored guest answers within seconds: one that does not is given up for a boot */
const WARM_HELLO_TIMEOUT = Duration.minutes(1)

/** the last `max` characters of a turn's output, cut at a line where one is near */
export const outputTail = (text: string, max = 4000): string => {
  if (text.length <= max) return text
  const cut = text.slice(-max)
  const line = cut.indexOf("\n")
  return line === -1 || line > 200 ? cut : cut.slice(line + 1)
}

/**
 * One shell turn to its end: its output as it comes to `onOutput`, its status and the tail of its
 * output (stdout and stderr as they came) returned.
 */
export const runCollecting = (
  session: Pick<Session, "turn">,
  command: string,
  onOutput: ((event: TurnEvent) => Effect.Effect<void>) | undefined
) =>
  Effect.gen(function* () {
    let text = ""
    let end: Extract<TurnEvent, { _tag: "End" }> | undefined
    yield* session.turn(command).pipe(
      Stream.runForEach((event) => {
        if (event._tag === "End") end = event
        else if (event.event.kind === "stdout" || event.event.kind === "stderr") {
          text = outputTail(text + event.event.data, 64 * 1024)
        }
        return onOutput?.(event) ?? Effect.void
      })
    )
    return { exitCode: end?.exitCode ?? null, signal: end?.signal ?? null, tail: outputTail(text) }
  })

const runInstall = (
  session: Session,
  command: string,
  source: string,
  onOutput: ((event: TurnEvent) => Effect.Effect<void>) | undefined
) =>
  Effect.gen(function* () {
    const result = yield* runCollecting(session, command, onOutput)
    if (result.exitCode !== 0) {
      return yield* new EnvironmentInstallFailed({
        source,
        exitCode: result.exitCode,
        logTail: result.tail,
        message: `the environment's install command failed (${result.exitCode === null ? `signal ${result.signal}` : `exit ${result.exitCode}`}): ${command}\n${result.tail}`
      })
    }
  })

/**
 * Runs `build` in a scope of its own, forked from the caller's: on success its resources join
 * the caller's scope; on failure they are released at once (e.g. a failed warm restore's VM
 * stopped and its rpc.sock freed before the boot that replaces it).
 */
const isolated = <A, E, R>(build: Effect.Effect<A, E, R | Scope.Scope>) =>
  Effect.gen(function* () {
    const scope = yield* Scope.fork(yield* Effect.scope, ExecutionStrategy.sequential)
    return yield* build.pipe(
      Scope.extend(scope),
      Effect.onExit((exit) => (Exit.isSuccess(exit) ? Effect.void : Scope.close(scope, exit)))
    )
  })

/**
 * Runs `build` in a scope of its own (`isolated`): on success the resources join the caller's
 * scope; on failure or interruption they are released at once (VM stopped, lock freed) and
 * `undo` runs, so nothing half-made is left.
 */
const transactional = <A, E, R, E2, R2>(
  build: Effect.Effect<A, E, R | Scope.Scope>,
  undo: Effect.Effect<void, E2, R2>
) => isolated<A, E, R>(build).pipe(Effect.onError(() => Effect.ignore(undo)))

/**
 * A failed Open removes its session directory: the VM's logs (the guest console, the VMM's own
 * log) are kept first in `$ABOX_HOME/failed-open/`, replacing the previous failure's, so that
 * why a VM did not start can still be read (and sent). Best effort: nothing here fails the undo.
 */
const keepFailedOpenLogs = (dir: string, keep: string) =>
  Effect.tryPromise(async () => {
    const logs = [sessionFile(dir, "consoleLog"), sessionFile(dir, "vfkitLog")]
    const present = await Promise.all(
      logs.map((file) =>
        fs.stat(file).then(
          (stat) => (stat.isFile() && stat.size > 0 ? file : undefined),
          () => undefined
        )
      )
    )
    const found = present.filter((file): file is string => file !== undefined)
    if (found.length === 0) return
    await fs.rm(keep, { recursive: true, force: true })
    await fs.mkdir(keep, { recursive: true, mode: 0o700 })
    for (const file of found) {
      const kept = path.join(keep, path.basename(file))
      await fs.copyFile(file, kept)
      await fs.chmod(kept, 0o600)
    }
  }).pipe(Effect.ignore)

/**
 * Open: new id → lock → snapshot the source → clone golden → config → boot → hello →
 * transfer into /work/repo → ready. A failure at any step undoes what was done: the VM is
 * stopped, the lock freed, the new session directory and its name removed.
 */
export const open = Effect.fn("open")(function* (options: OpenOptions) {
  const store = yield* SessionStore
  const paths = yield* AboxPaths
  const lock = yield* RuntimeLock
  const images = yield* Images
  const vmm = yield* VmmBackend

  yield* checkResources(options)
  yield* phase(options, "snapshot")
  // resolved once (a source path that is a symlink names its target) and scanned: an unreadable
  // entry is a SourceInvalid naming it, before anything is made
  const snapshot = yield* snapshotSource(options.source)
  const scan = snapshot.scan
  const policy = options.policy ?? (yield* defaultPolicy)
  const image = yield* images.resolve(options.image)
  if (image.arch !== vmm.arch) {
    return yield* new VmmError({
      backend: vmm.name,
      reason: "arch",
      message: `image ${image.identity.name} is ${image.arch}; the ${vmm.name} backend here runs ${vmm.arch} guests`
    })
  }
  const tools = vmm.repoDiskFormat === undefined ? undefined : yield* repoDiskTools(vmm.repoDiskFormat)
  const resources = {
    cpus: options.cpus ?? DEFAULT_CPUS,
    memoryMiB: options.memoryMiB ?? DEFAULT_MEMORY_MIB
  }
  // before the session exists: a snapshot made here holds no session's anything
  const warm = yield* warmSnapshotFor(image, resources, { enabled: options.warm })
  if (warm._tag === "Cold") yield* Effect.logDebug(`open: booting (no warm open): ${warm.reason}`)
  else
    yield* Effect.logDebug(`open: restoring the warm snapshot ${warm.dir}${warm.built ? " (made now)" : ""}`)

  // binds the name too (NameTaken before anything is made); undo removes both
  const meta = yield* store.create({
    source: scan.root,
    model: options.model ?? DEFAULT_MODEL,
    name: options.name,
    image: image.identity,
    guest: { arch: image.arch, protocol: image.protocol },
    vmm: { backend: vmm.name },
    resources,
    policy
  })
  // create makes every new session in the current home
  const session: SessionLocation = { id: meta.id, dir: paths.sessionDir(meta.id), legacy: false }
  const dir = session.dir
  const progress = (done: boolean) =>
    options.onProgress?.({
      files: done ? scan.files : 0,
      bytes: done ? scan.bytes : 0,
      totalFiles: scan.files,
      totalBytes: scan.bytes
    }) ?? Effect.void

  return yield* transactional(
    Effect.gen(function* () {
      const held = yield* lock.acquire(session)
      yield* phase(options, "clone")
      // the snapshot as a disk built here (no per-file work in the guest), where the backend
      // attaches one and the tools are present; else a tar streamed in after the hello
      const makeDisks = Effect.gen(function* () {
        if (vmm.repoDiskFormat === undefined || tools === undefined) return undefined
        yield* phase(options, "transfer")
        yield* progress(false)
        const built = yield* buildRepoDisks(scan, dir, vmm.repoDiskFormat, tools)
        if (built !== undefined) yield* progress(true)
        return built
      })
      let disks: RepoDisks | undefined = yield* makeDisks
      // warm: the snapshot's root copied, the VM restored, the repository disks plugged in; a
      // restore that fails boots instead, from disks made anew (the failed guest may have
      // mounted them)
      const restored =
        warm._tag === "Cold"
          ? undefined
          : yield* isolated(
              Effect.gen(function* () {
                const root = yield* copyWarmRoot(image, warm.root, dir)
                const made = yield* store.update(meta.id, (current) => ({ ...current, rootDisk: root.info }))
                const booted = yield* boot(
                  made,
                  dir,
                  image,
                  held,
                  {
                    ...options,
                    helloTimeout: Duration.min(
                      Duration.decode(options.helloTimeout ?? DEFAULT_HELLO_TIMEOUT),
                      WARM_HELLO_TIMEOUT
                    )
                  },
                  policy,
                  disks,
                  { state: warm.state, manifest: warm.manifest }
                )
                return { made, booted }
              })
            ).pipe(
              Effect.tapError((error) =>
                Effect.logDebug(`open: the warm snapshot ${warm.dir} did not restore, booting: ${error.message}`)
              ),
              Effect.option,
              Effect.map(Option.getOrUndefined)
            )
      let made: SessionMeta
      let booted: Effect.Effect.Success<ReturnType<typeof boot>>
      if (restored !== undefined) {
        made = restored.made
        booted = restored.booted
      } else {
        if (warm._tag === "Warm" && disks !== undefined) {
          yield* removeRepoDisks(dir)
          disks = yield* makeDisks
        }
        // an overlay of the golden where the backend attaches qcow2 (QEMU), recorded for resume
        const root = yield* images.cloneRoot(image, dir, vmm.rootDiskFormat === "qcow2")
        made = yield* store.update(meta.id, (current) => ({ ...current, rootDisk: root.info }))
        booted = yield* boot(made, dir, image, held, options, policy, disks)
      }
      if (disks === undefined || booted.connection.hello.repoDisk !== true) {
        yield* phase(options, "transfer")
        yield* progress(false)
        // the tar's bytes as they go (headers included, so a little above the files' bytes)
        let sent = 0
        let told = 0
        const counted = snapshot.tar.pipe(
          Stream.tap((chunk) => {
            sent += chunk.length
            if (options.onProgress === undefined || sent - told < 1024 * 1024) return Effect.void
            told = sent
            return options.onProgress({
              files: 0,
              bytes: Math.min(sent, scan.bytes),
              totalFiles: scan.files,
              totalBytes: scan.bytes
            })
          })
        )
        yield* booted.connection.transfer(counted, GUEST_REPO, { baseline: true })
        yield* progress(true)
      }
      const opened = sessionFrom(made, dir, booted, snapshot.skipped)
      if (options.install !== undefined) {
        yield* phase(options, "install")
        yield* runInstall(opened, options.install, scan.root, options.onInstallOutput)
      }
      yield* phase(options, "ready")
      return opened
    }),
    Effect.zipRight(keepFailedOpenLogs(dir, paths.homeFile("failedOpen")), store.remove(meta.id))
  )
})

/**
 * Resume(id | name): lock first (a concurrent resume fails `SessionBusy` before any config or
 * disk is touched) → session.json → compatibility with this host → config rewritten
 * (secretless, current model) → `qemu-img check` of a qcow2 root → boot the existing root disk →
 * hello (too old → GuestTooOld).
 * The source directory is never copied again; nothing is inferred from the current directory.
 */
export const resume = Effect.fn("resume")(function* (ref: string, options: BootOptions = {}) {
  const store = yield* SessionStore
  const lock = yield* RuntimeLock
  const images = yield* Images
  const vmm = yield* VmmBackend

  yield* checkResources(options)
  const session = yield* store.locate(ref)
  const id = session.id
  return yield* transactional(
    Effect.gen(function* () {
      const held = yield* lock.acquire(session)
      const recorded = yield* store.get(id)
      const compat = yield* checkCompatibility(recorded, {
        os: process.platform,
        arch: hostArch(),
        backend: vmm.name
      })
      // a standalone session (its image was removed with --force) boots its own kernel and initrd
      const own = yield* standaloneKernel(session.dir)
      const image =
        own ??
        (yield* images.resolve(
          recorded.image !== undefined ? `${recorded.image.name}@${recorded.image.digest}` : undefined
        ))
      // a VM killed mid-write leaves at worst leaked clusters: reclaimed here; corruption refused
      const root = sessionRootDisk(session.dir, recorded.rootDisk)
      // a VM forked while it ran went on in `next` overlays: they are its disks from now on
      yield* settleDisks(session.dir)
      if (root.format === "qcow2") yield* checkOverlay(root.file)
      const policy = options.policy ?? recorded.policy ?? (yield* defaultPolicy)
      const previousEnv = (yield* store.readGuestConfig(id).pipe(Effect.option)).pipe(
        Option.flatMap((config) => Option.fromNullable(config.env)),
        Option.getOrUndefined
      )
      const now = yield* Clock.currentTimeMillis
      const meta = yield* store.update(id, (current) => ({
        ...current,
        model: options.model ?? current.model,
        // resources given to this resume are the session's from now on (as the model is)
        ...(options.cpus !== undefined || options.memoryMiB !== undefined
          ? {
              resources: {
                cpus: options.cpus ?? current.resources?.cpus ?? DEFAULT_CPUS,
                memoryMiB: options.memoryMiB ?? current.resources?.memoryMiB ?? DEFAULT_MEMORY_MIB
              }
            }
          : {}),
        policy,
        guest: compat.guest,
        vmm: compat.vmm,
        ...(compat.backfilled ? { backfilled: new Date(now).toISOString() } : {})
      }))
      const booted = yield* boot(
        meta,
        session.dir,
        { ...image, arch: compat.guest.arch },
        held,
        // the environment's env (docs/environments.md) stays the session's: the last config's
        { ...options, model: meta.model, env: options.env ?? previousEnv },
        policy,
        // a backend without repository disks cannot resume a session that has them
        vmm.repoDiskFormat === undefined ? undefined : yield* existingRepoDisks(session.dir)
      )
      const connection = booted.connection
      // the guest's own word on its protocol wins over what was recorded (or backfilled)
      const current =
        connection.hello.protocol === meta.guest?.protocol
          ? meta
          : yield* store.update(id, (m) => ({
              ...m,
              guest: { arch: compat.guest.arch, protocol: connection.hello.protocol }
            }))
      yield* phase(options, "ready")
      return sessionFrom(current, session.dir, booted, [])
    }),
    Effect.void
  )
})
