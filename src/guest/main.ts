/**
 * abox-guest: the agent inside the VM (bundled to dist/abox-guest.js and baked into images).
 * The image's init runs it as root with no flags when the image has no usable startup snapshot
 * (see snapshot.ts); FakeVmm runs it on the host with flags.
 */
import { main } from "./agentMain.js"

export { GUEST_BUILD, GUEST_VERSION, GuestExit } from "./agentMain.js"

await main(process.argv.slice(2))
