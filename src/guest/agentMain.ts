/**
 * The guest agent's program: `main(argv)`. Two entries run it: `main.ts` (the ESM bundle
 * dist/abox-guest.js, which FakeVmm runs on the host and images fall back to) and `snapshot.ts`
 * (a V8 startup snapshot built at image-build time, which the image's init runs first).
 *
 * Start-up is on every boot's critical path, so this is plain async TypeScript over the
 * Mux (plain TypeScript too) with effect/Schema for every decode: no Effect runtime loop, no
 * @effect/platform-node, no @effect/cli. Raw node:* calls are the point here (fds of a virtio
 * port, uid/gid of child processes, process groups, signals, fsync).
 *
 * Nothing here may touch the process at load time (no timers, handles, env or argv reads that
 * matter later): a startup snapshot runs the module's top level at build time, not at boot.
 */
import { spawn } from "node:child_process"
import * as fs from "node:fs/promises"
import { existsSync } from "node:fs"
import * as path from "node:path"
import * as Either from "effect/Either"
import {
  CONFIG_DISK_HEADER,
  CONFIG_DISK_MAX_JSON,
  decodeConfigDisk,
  describeConfigDiskProblem
} from "../protocol/ConfigDisk.js"
import type { GuestConfig } from "../protocol/GuestConfig.js"
import type { ControlMessage } from "../protocol/Messages.js"
import { GUEST_RECEIVE_WINDOW, Mux } from "../protocol/Mux.js"
import { archName, GuestAgent, type AgentEnd, type AgentLink } from "./agent.js"
import { guestProxyEnv, startConnectProxy, type TunnelOpenResult } from "./connectProxy.js"
import { CREDENTIAL_PLACEHOLDER } from "../protocol/GuestConfig.js"
import { ensureStateDir, loadContext } from "./context.js"
import { GUEST_USAGE, parseArgs, rpcTarget, type GuestFlags } from "./flags.js"
import { mountRepoDisks, type RepoDisks } from "./repoDisk.js"
import { announceWaiting, applyHandoff, awaitHandoff, kernelSaysWait } from "./handoff.js"
import { openRpc } from "./rpcPort.js"
import { TunnelClient } from "./tunnels.js"
import { PromptRunner } from "./prompts.js"
import { TurnRunner, turnEnv } from "./turns.js"
import { BUSYBOX, TtyTurnRunner } from "./ttyTurns.js"
import { TurnSlot } from "./turnSlot.js"
import { isRoot, resolveUser, type TurnUser } from "./user.js"
import { readImageEnv } from "./imageEnv.js"
import { errorMessage as errorText } from "../domain/errorMessage.js"

export const GUEST_VERSION = "0.1.0"
export const GUEST_BUILD = `abox-guest ${GUEST_VERSION} (${process.platform}-${process.arch}, node ${process.versions.node})`

/** exit statuses of the agent process (the init script logs it and powers off anyway) */
export const GuestExit = {
  Ok: 0,
  BadConfig: 2,
  NoRpc: 3,
  Disconnected: 4,
  ProtocolError: 5,
  Setup: 6,
  Usage: 64
} as const

const log = (line: string): void => {
  process.stderr.write(`abox-guest: ${line}\n`)
}

const readFully = async (handle: fs.FileHandle, buffer: Buffer, position: number): Promise<number> => {
  let filled = 0
  while (filled < buffer.length) {
    const { bytesRead } = await handle.read(buffer, filled, buffer.length - filled, position + filled)
    if (bytesRead === 0) break
    filled += bytesRead
  }
  return filled
}

/**
 * The config disk: its header, then only the JSON length it names (at most the max JSON bytes),
 * whatever the device size. decodeConfigDisk checks magic, layout, length and checksum.
 */
const readConfigDisk = async (file: string): Promise<Either.Either<GuestConfig, string>> => {
  let handle
  try {
    handle = await fs.open(file, "r")
  } catch (error) {
    return Either.left(`cannot open the config disk ${file}: ${errorText(error)}`)
  }
  try {
    const header = Buffer.alloc(CONFIG_DISK_HEADER)
    const headerBytes = await readFully(handle, header, 0)
    const named = headerBytes === CONFIG_DISK_HEADER ? header.readUInt32BE(12) : 0
    const body = Buffer.alloc(Math.min(named, CONFIG_DISK_MAX_JSON + 1))
    const bodyBytes = await readFully(handle, body, CONFIG_DISK_HEADER)
    const disk = Buffer.concat([header.subarray(0, headerBytes), body.subarray(0, bodyBytes)])
    return Either.mapLeft(decodeConfigDisk(disk), (problem) => describeConfigDiskProblem(problem))
  } catch (error) {
    return Either.left(`cannot read the config disk ${file}: ${errorText(error)}`)
  } finally {
    await handle.close()
  }
}

/**
 * The egress (CONNECT) proxy, started at boot before any turn: every turn process gets the proxy
 * variables and, when the config carries the session's broker CA, the CA bundle variables. Files
 * turn processes must read (the CA, the bundle) go to `--run`, not to the root-only state dir.
 */
export interface EgressProxy {
  readonly env: Readonly<Record<string, string>>
  /** the proxy's port on 127.0.0.1 (absent: it did not start) */
  readonly port?: number
  readonly onTunnelMessage?: (message: ControlMessage) => void
  /** a broker tunnel without the proxy's loopback hop (the model agent's own requests) */
  readonly openTunnel?: (host: string, port: number) => Promise<TunnelOpenResult>
  readonly close: () => void
}

const SYSTEM_CA_BUNDLES = [
  "/etc/ssl/certs/ca-certificates.crt",
  "/etc/pki/tls/certs/ca-bundle.crt",
  "/etc/ssl/cert.pem"
]
const CA_VARIABLES = [
  "NODE_EXTRA_CA_CERTS",
  "SSL_CERT_FILE",
  "CURL_CA_BUNDLE",
  "REQUESTS_CA_BUNDLE",
  "GIT_SSL_CAINFO",
  "PIP_CERT",
  "npm_config_cafile",
  "AWS_CA_BUNDLE",
  "DENO_CERT"
]

/** the CAs the agent adds to the guest's trust: the session's broker CA, then the policy's guestCaFiles */
export const addedCaPems = (config: GuestConfig): ReadonlyArray<string> => [
  ...(config.brokerCaCert === undefined ? [] : [config.brokerCaCert]),
  ...(config.extraCaCerts ?? [])
]

const writeCaFiles = async (runDir: string, pems: ReadonlyArray<string>) => {
  await fs.mkdir(runDir, { recursive: true, mode: 0o755 })
  await fs.chmod(runDir, 0o755)
  const sessionCaPath = path.join(runDir, "session-ca.pem")
  const caBundlePath = path.join(runDir, "ca-bundle.pem")
  let system = ""
  for (const candidate of SYSTEM_CA_BUNDLES) {
    system = await fs.readFile(candidate, "utf8").catch(() => "")
    if (system !== "") break
  }
  const sessionPem = pems.map((pem) => (pem.endsWith("\n") ? pem : `${pem}\n`)).join("")
  await fs.writeFile(sessionCaPath, sessionPem, { mode: 0o644 })
  await fs.writeFile(
    caBundlePath,
    `${system}${system === "" || system.endsWith("\n") ? "" : "\n"}${sessionPem}`,
    {
      mode: 0o644
    }
  )
  // GNU wget (GnuTLS) reads no CA variable: a wgetrc names the bundle (WGETRC; /etc/wgetrc still applies)
  const wgetrcPath = path.join(runDir, "wgetrc")
  await fs.writeFile(wgetrcPath, `ca_certificate = ${caBundlePath}\n`, { mode: 0o644 })
  return { sessionCaPath, caBundlePath, wgetrcPath }
}

/** credentials the broker adds on the host side: the turn sees their names with a placeholder value */
export const placeholderEnv = (config: GuestConfig): Record<string, string> =>
  Object.fromEntries((config.placeholderEnv ?? []).map((name) => [name, CREDENTIAL_PLACEHOLDER]))

export const startEgressProxy = async (
  link: AgentLink,
  config: GuestConfig,
  flags: GuestFlags
): Promise<EgressProxy> => {
  const tunnels = new TunnelClient(link, log)
  let proxy
  try {
    proxy = await startConnectProxy({ openTunnel: (host, port) => tunnels.request(host, port) })
  } catch (error) {
    log(`the egress proxy did not start, turns run offline: ${errorText(error)}`)
    return { env: {}, close: () => undefined }
  }
  let env: Record<string, string>
  const added = addedCaPems(config)
  if (added.length === 0) {
    env = guestProxyEnv({ port: proxy.port, caBundlePath: "", sessionCaPath: "" })
    for (const name of CA_VARIABLES) delete env[name]
  } else {
    const { wgetrcPath, ...caFiles } = await writeCaFiles(flags.run, added)
    env = { ...guestProxyEnv({ port: proxy.port, ...caFiles }), WGETRC: wgetrcPath }
  }
  log(`egress proxy on 127.0.0.1:${proxy.port}${config.brokerCaCert === undefined ? " (no broker CA)" : ""}`)
  const running = proxy
  return {
    env,
    port: proxy.port,
    onTunnelMessage: (message) => tunnels.onMessage(message),
    openTunnel: (host, port) => tunnels.request(host, port),
    close: () => {
      tunnels.close()
      void running.close()
    }
  }
}

/** how long a warm open's hot-plugged repository disks are waited for */
const HOTPLUG_WAIT_MS = 30_000

const runCommand = (command: string, args: ReadonlyArray<string>): Promise<number | null> =>
  new Promise((resolve) => {
    const child = spawn(command, args, { stdio: "inherit" })
    child.once("error", () => resolve(null))
    child.once("exit", (code) => resolve(code))
  })

/**
 * After a restore of the VM's saved memory (`resumed`): in a VM, the clock from the host (it
 * stood still while the VM was saved) and the host's entropy written into the kernel pool
 * (/dev/urandom mixes what is written into it: a fork does not go on with its parent's pool);
 * and a fork's own broker CA in the trust files every turn reads (same paths, new content).
 */
const onResumed =
  (flags: GuestFlags, config: GuestConfig, trust: { pems: ReadonlyArray<string> }) =>
  async (resumed: {
    readonly unixMillis: number
    readonly entropy: string
    readonly brokerCaCert?: string | undefined
  }) => {
    if (flags.onShutdown === "poweroff") {
      await fs.writeFile("/dev/urandom", Buffer.from(resumed.entropy, "base64"))
      const code = await runCommand("date", ["-u", "-s", `@${Math.floor(resumed.unixMillis / 1000)}`])
      if (code !== 0) log(`could not set the clock (date exited ${code})`)
    }
    if (resumed.brokerCaCert !== undefined && config.brokerCaCert !== undefined) {
      const pems = [resumed.brokerCaCert, ...(config.extraCaCerts ?? [])]
      await writeCaFiles(flags.run, pems)
      // the model client's next connection trusts it too, and the old CA no longer
      trust.pems = pems
      log("trusting this session's own broker CA")
    }
  }

const finish = async (flags: GuestFlags, code: number): Promise<never> => {
  if (flags.onShutdown === "poweroff" && code === GuestExit.Ok) {
    await runCommand("sync", [])
    await runCommand("poweroff", ["-f"])
  }
  process.exit(code)
}

const endCode = (end: AgentEnd): number =>
  end === "shutdown"
    ? GuestExit.Ok
    : end === "disconnected"
      ? GuestExit.Disconnected
      : GuestExit.ProtocolError

export const main = async (argv: ReadonlyArray<string>): Promise<never> => {
  // A virtio port is read with blocking reads on the libuv thread pool (see rpcPort.ts): give the
  // pool room for it and for tar extraction. Set before the pool's first use (here, not at load
  // time: a snapshot's load-time environment is the build host's).
  process.env.UV_THREADPOOL_SIZE ??= "8"
  const parsed = parseArgs(argv)
  if (Either.isLeft(parsed)) {
    process.stderr.write(`abox-guest: ${parsed.left}\n${GUEST_USAGE}\n`)
    process.exit(GuestExit.Usage)
  }
  if (parsed.right._tag === "Help") {
    process.stdout.write(`${GUEST_USAGE}\n`)
    process.exit(GuestExit.Ok)
  }
  const flags = parsed.right.flags
  const started = performance.now()

  let rpc
  try {
    rpc = await openRpc(rpcTarget(flags.rpc))
  } catch (error) {
    log(`cannot open the RPC channel ${flags.rpc}: ${errorText(error)}`)
    process.exit(GuestExit.NoRpc)
  }
  // warm open: no config disk; the session comes as the host's first message after a restore
  const waiting = flags.session === "wait" || (flags.session === "auto" && (await kernelSaysWait()))
  if (waiting) {
    try {
      await announceWaiting(rpc.stream)
    } catch (error) {
      log(`cannot announce on the RPC channel: ${errorText(error)}`)
      process.exit(GuestExit.NoRpc)
    }
    log("waiting for a session")
  }
  const mux = new Mux(rpc.stream, { receiveWindow: GUEST_RECEIVE_WINDOW })
  const fail = async (code: string, message: string, exit: number): Promise<never> => {
    log(message)
    await mux.sendControl({ type: "error", code, message }).catch(() => undefined)
    mux.close()
    process.exit(exit)
  }

  let config: Either.Either<GuestConfig, string>
  // a warm open's repository disks are hot-plugged: looked for until they appear
  let hotplugWaitMs = 0
  if (waiting) {
    const handoff = await awaitHandoff(mux)
    if (typeof handoff === "string") return fail("bad_config", handoff, GuestExit.BadConfig)
    if (isRoot()) await applyHandoff(handoff, log)
    config = Either.right(handoff.config)
    if (handoff.repoDisks === true) hotplugWaitMs = HOTPLUG_WAIT_MS
  } else config = await readConfigDisk(flags.config)
  if (Either.isLeft(config)) return fail("bad_config", config.left, GuestExit.BadConfig)

  let user: TurnUser | undefined
  let history
  let disks: RepoDisks = { repo: false, baseline: false }
  let messages: ReadonlyArray<unknown> = []
  // an environment's setup VM: root turns, a read-only repository, no conversation kept on the root disk
  const setupVm = config.right.setup === true
  const stateDir = setupVm ? path.join(flags.run, "setup-state") : flags.state
  try {
    user = isRoot() && !setupVm ? await resolveUser(flags.user) : undefined
    await ensureStateDir(stateDir)
    const loaded = await loadContext(stateDir)
    if (loaded.keptAside !== undefined) {
      log(`context.json did not decode (${loaded.keptAside.reason}); kept as ${loaded.keptAside.path}`)
    }
    history = loaded.turns
    messages = loaded.messages
    await fs.mkdir(flags.repo, { recursive: true, mode: 0o755 })
    if (flags.repoDisks === "auto" && isRoot()) disks = await mountRepoDisks(flags.repo, stateDir, setupVm, hotplugWaitMs)
    if (user !== undefined) await fs.chown(flags.repo, user.uid, user.gid)
  } catch (error) {
    return fail("setup_failed", `guest setup failed: ${errorText(error)}`, GuestExit.Setup)
  }

  const proxy = await startEgressProxy(mux, config.right, flags)
  // the CAs the model client trusts: the boot's, replaced after a restore (`resumed`)
  const trust = { pems: addedCaPems(config.right) }
  const turnEnvironment = {
    repoDir: flags.repo,
    model: config.right.model,
    user,
    agentArgv: config.right.agent?.argv,
    // an imported image's Env first: abox's own variables win
    extraEnv: { ...(await readImageEnv(log)), ...config.right.env, ...placeholderEnv(config.right), ...proxy.env }
  }
  // one turn at a time, whichever its kind: the three runners share one slot
  const slot = new TurnSlot()
  const runner = new TurnRunner(turnEnvironment, slot)
  // tty turns need BusyBox's telnetd (the image's /bin/busybox); without it hello does not offer them
  const tty = existsSync(BUSYBOX) ? new TtyTurnRunner(turnEnvironment, BUSYBOX, slot) : undefined
  // the model agent: its bundle loads on the first prompt turn, not here
  const saver: { agent?: GuestAgent } = {}
  const prompts = new PromptRunner({
    // each finished step of a prompt turn is saved at once (a VM killed mid-turn keeps it)
    onStep: () => saver.agent?.saveProgress() ?? Promise.resolve(),
    spec: config.right.modelSpec,
    maxSteps: config.right.maxSteps,
    repoDir: flags.repo,
    user,
    env: turnEnv(turnEnvironment),
    messages,
    proxyPort: proxy.port,
    openTunnel: proxy.openTunnel,
    caPems: () => trust.pems,
    log
  }, slot)
  // SIGTERM (the VMM's or FakeVmm's fallback signal): nothing of a turn may outlive the agent
  process.once("SIGTERM", () => {
    runner.killNow()
    prompts.killNow()
    tty?.killNow()
    process.exit(128 + 15)
  })
  const agent = new GuestAgent({
    link: mux,
    arch: archName(process.arch),
    build: GUEST_BUILD,
    repoDir: flags.repo,
    stateDir,
    runner,
    slot,
    prompts,
    tty,
    history,
    owner: user === undefined ? undefined : { uid: user.uid, gid: user.gid },
    ignoreShutdown: config.right.ignoreShutdown,
    onTunnelMessage: proxy.onTunnelMessage,
    log,
    repoDisk: disks.repo,
    onResumed: onResumed(flags, config.right, trust),
    // in a VM the host may stop it without the guest's help (its supervisor killed): a turn's
    // writes are synced before its end is reported (on the host, FakeVmm, the host's disks are not ours)
    settle: flags.onShutdown === "poweroff" ? () => runCommand("sync", []).then(() => undefined) : undefined
  })
  saver.agent = agent
  log(
    `session ${config.right.sessionId} on ${rpc.describe}, ${history.length} turns remembered, ` +
      `turns run as ${user === undefined ? "this user" : `${user.name} (${user.uid}:${user.gid})`}; ` +
      `saying hello after ${Math.round(performance.now() - started)} ms ` +
      `(node up ${Math.round(process.uptime() * 1000)} ms)`
  )
  const end = await agent.run()
  log(`conversation ended: ${end}`)
  if (config.right.ignoreShutdown === true) {
    // a test image playing a stuck guest: it stays up until the VMM's signal or SIGKILL
    log("ignoreShutdown is set: staying up until signalled")
    await new Promise<never>(() => setInterval(() => undefined, 1 << 30))
  }
  proxy.close()
  mux.close()
  return finish(flags, endCode(end))
}
