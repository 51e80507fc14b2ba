// Sessions by name: start, connect (resume), list, stop.
//   node examples/sdk/manager.mjs [repo-dir]
import { SessionManager } from "abox"

const source = process.argv[2] ?? new URL("../hello", import.meta.url).pathname
const name = `demo-${process.pid}`
const manager = new SessionManager()

const first = await manager.start(name, { source, timeout: 600 }) // closes after 10 idle minutes
await first.run("echo remembered > note.txt")
await manager.stop(name) // the VM stops; the session stays on disk

const again = await manager.connect(name) // boots the same disk again
const { stdout } = await again.run("cat note.txt")
console.log(`after resume: ${stdout.trim()}`)
console.log((await manager.list()).map((s) => `${s.name} → ${s.sessionId}${s.running ? " (running)" : ""}`).join("\n"))
await manager.stop(name)
