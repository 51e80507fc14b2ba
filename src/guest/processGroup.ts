/**
 * Process groups the agent started itself (a turn's, a tool's, the owner's file child): each is
 * spawned `detached`, its own group, so one signal reaches the whole tree and never the agent.
 * A pid a turn user wrote (a tty turn's pid file) is not one of these: it is signalled with the
 * user's rights (ttyTurns.ts), never here.
 */

/** signal a whole process group; ESRCH (already gone) is not an error; pid ≤ 1 is never signalled */
export const killGroup = (pid: number | undefined, signal: NodeJS.Signals): void => {
  if (pid === undefined || pid <= 1) return
  try {
    process.kill(-pid, signal)
  } catch {
    // the group is gone
  }
}
