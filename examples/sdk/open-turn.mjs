// Open a session on a repository, stream one turn, close.
//   node examples/sdk/open-turn.mjs [repo-dir] [turn]
// (TypeScript 5.2+ can write `await using session = await open(...)` instead of try/finally.)
import { open } from "abox"

const source = process.argv[2] ?? new URL("../hello", import.meta.url).pathname
const turn = process.argv[3] ?? "./greet.sh"

const session = await open({ source })
try {
  console.error(`session ${session.id}`)
  for await (const event of session.turn(turn)) {
    if (event._tag === "End") console.error(`exit ${event.exitCode ?? event.signal}`)
    else if (event.event.kind === "stdout") process.stdout.write(event.event.data)
    else if (event.event.kind === "stderr") process.stderr.write(event.event.data)
  }
} finally {
  await session.close() // Close: shutdown RPC → bounded stop of the VM → unlock
}
