// Raw node:fs: tests look at /proc directly (Linux) to see which processes are really there.
import * as fs from "node:fs"

const stateOf = (pid: number | string): string => {
  const stat = fs.readFileSync(`/proc/${pid}/stat`, "utf8")
  return stat.slice(stat.lastIndexOf(")") + 2, stat.lastIndexOf(")") + 3)
}

/** running: not gone, and not a zombie waiting for its reaper (after its parent was SIGKILLed) */
export const alive = (pid: number): boolean => {
  try {
    return stateOf(pid) !== "Z"
  } catch {
    return false
  }
}

/** pids of live processes (not this one) whose command line mentions `needle` */
export const processesMentioning = (needle: string): Array<number> => {
  const found: Array<number> = []
  for (const entry of fs.readdirSync("/proc")) {
    if (!/^\d+$/.test(entry) || Number(entry) === process.pid) continue
    try {
      if (fs.readFileSync(`/proc/${entry}/cmdline`, "utf8").includes(needle) && stateOf(entry) !== "Z")
        found.push(Number(entry))
    } catch {
      // gone meanwhile
    }
  }
  return found
}
