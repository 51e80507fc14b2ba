import type { GuestArch } from "../domain/session.js"

/** the guest architecture this host runs natively (node's `arm64` is the guest's `aarch64`) */
export const hostArch = (arch: string = process.arch): GuestArch => (arch === "arm64" ? "aarch64" : "x86_64")
