// A supervisor for the liveness test: locks the session, boots it, prints READY, then waits to be killed.
import * as Effect from "effect/Effect"
import * as fs from "node:fs"
import { createRequire } from "node:module"
import * as path from "node:path"
import { writeConfigDisk } from "../src/lib/disk.js"
import { GuestRpc } from "../src/services/GuestRpc.js"
import { VmmBackend } from "../src/services/VmmBackend.js"
import { vmLayer } from "./e2e-vm-image.js"

const [dir, kernel, initrd] = process.argv.slice(2) as [string, string, string]
const locks = createRequire(import.meta.url)("fs-native-extensions") as { tryLock: (fd: number) => boolean }

const program = Effect.gen(function* () {
  const lockFd = fs.openSync(path.join(dir, "lock"), "a")
  if (!locks.tryLock(lockFd)) return yield* Effect.die("lock busy")
  yield* writeConfigDisk(path.join(dir, "config.raw"), { format: 1, sessionId: "liveness", model: "test" })
  const rpc = yield* GuestRpc
  const vmm = yield* VmmBackend
  const listener = yield* rpc.listen(path.join(dir, "rpc.sock"), {
    helloTimeout: "90 seconds",
    shutdownTimeout: "5 seconds"
  })
  const vm = yield* vmm.start({
    sessionId: "liveness",
    sessionDir: dir,
    arch: "x86_64",
    kernel,
    initrd,
    rootDisk: path.join(dir, "root.raw"),
    configDisk: path.join(dir, "config.raw"),
    rpcSocket: path.join(dir, "rpc.sock"),
    consoleLog: path.join(dir, "console.log"),
    cpus: 2,
    memoryMiB: 1024,
    lockFd,
    bounds: { graceful: "10 seconds", signalled: "5 seconds", killed: "5 seconds" }
  })
  yield* listener.accept
  process.stdout.write(`READY ${vm.helperPid} ${vm.vmmPid}\n`)
  return yield* Effect.never
})

Effect.runFork(Effect.scoped(program).pipe(Effect.provide(vmLayer)))
