/**
 * Warm open, the guest's half (docs/protocol.md "Warm open"). A guest booted with
 * `abox.session=wait` on its kernel command line has no config disk: it writes WARM_READY on its
 * RPC port (raw, before any frame: the host that builds the image's warm snapshot saves the VM's
 * memory when it reads it) and waits. Each restore of that snapshot gets a new host connection,
 * whose first message is `session` {config, time, entropy}: the clock is set, the entropy mixed
 * into the kernel's pool and a reseed of its generator forced where the image can (every warm
 * session must draw different random bytes), then the agent goes on as after a config disk.
 *
 * Plain TypeScript (the agent's start-up path); the message is decoded by the Mux's schema.
 */
import { spawn } from "node:child_process"
import * as fs from "node:fs/promises"
import type { Duplex } from "node:stream"
import type { Mux } from "../protocol/Mux.js"
import type { SessionHandoffMessage } from "../protocol/Messages.js"
import { WARM_READY } from "../protocol/Messages.js"
import { errorMessage } from "../domain/errorMessage.js"

/** true when the kernel command line asks the agent to wait for its session */
export const kernelSaysWait = async (cmdline = "/proc/cmdline"): Promise<boolean> => {
  const text = await fs.readFile(cmdline, "utf8").catch(() => "")
  return text.split(/\s+/).includes("abox.session=wait")
}

/** WARM_READY on the raw port, before the Mux sends anything */
export const announceWaiting = (stream: Duplex): Promise<void> =>
  new Promise((resolve, reject) => {
    stream.write(WARM_READY, (error) => (error === undefined || error === null ? resolve() : reject(error)))
  })

/** the host's first control message; anything else than `session` is refused (the reason) */
export const awaitHandoff = (mux: Mux): Promise<SessionHandoffMessage | string> =>
  new Promise((resolve) => {
    mux.onClose(() => resolve("the host closed the connection before the session arrived"))
    mux.onControl((message) => {
      resolve(message.type === "session" ? message : `the host sent ${message.type} before the session`)
    })
  })

const run = (command: string, args: ReadonlyArray<string>): Promise<number | null> =>
  new Promise((resolve) => {
    const child = spawn(command, args, { stdio: "ignore" })
    child.once("error", () => resolve(null))
    child.once("exit", (code) => resolve(code))
  })

/** RNDRESEEDCRNG (linux/random.h): the kernel rekeys its generator from the input pool now */
const RESEED_SCRIPT = "import fcntl,os\nfd=os.open('/dev/urandom',os.O_WRONLY)\nfcntl.ioctl(fd,0x5207)\n"

/**
 * The clock from the host and the host's entropy into the kernel's pool (root only; a failure is
 * logged and the session goes on: a wrong clock or an unforced reseed is not worth a dead Open).
 * Node has no ioctl: the reseed runs through python3 where the image has it; without it the
 * kernel rekeys at its next interval from a pool that already holds the host's bytes.
 */
export const applyHandoff = async (
  handoff: SessionHandoffMessage,
  log: (line: string) => void
): Promise<void> => {
  const entropy = Buffer.from(handoff.entropy, "base64")
  try {
    await fs.writeFile("/dev/urandom", entropy)
  } catch (error) {
    log(`cannot mix the host's entropy into /dev/urandom: ${errorMessage(error)}`)
  }
  const reseeded = await run("python3", ["-c", RESEED_SCRIPT])
  const seconds = Math.floor(handoff.time / 1000)
  const clock = await run("date", ["-u", "-s", `@${seconds}`])
  log(
    `session handed over: ${entropy.length} bytes of entropy${reseeded === 0 ? ", generator reseeded" : ""}; ` +
      `clock ${clock === 0 ? "set" : "not set"} to ${new Date(seconds * 1000).toISOString()}`
  )
}
