/**
 * The unprivileged user that owns the repository and runs every turn process (seed 000: "shell
 * and Git tool subprocesses run as the unprivileged guest repository owner"). Node has no
 * getpwnam, so a name is looked up in /etc/passwd; `uid:gid` needs no lookup (FakeVmm passes
 * 65534:65534, which exists on every host).
 */
import * as fs from "node:fs/promises"

export interface TurnUser {
  readonly name: string
  readonly uid: number
  readonly gid: number
  readonly home: string
}

const UID_GID = /^(\d+):(\d+)$/

export const parsePasswd = (text: string): ReadonlyArray<TurnUser> =>
  text.split("\n").flatMap((line) => {
    const fields = line.split(":")
    if (fields.length < 7) return []
    const uid = Number(fields[2])
    const gid = Number(fields[3])
    if (!Number.isInteger(uid) || !Number.isInteger(gid)) return []
    return [{ name: fields[0]!, uid, gid, home: fields[5]! }]
  })

export const resolveUser = async (spec: string, passwdFile = "/etc/passwd"): Promise<TurnUser> => {
  let passwd: ReadonlyArray<TurnUser> = []
  try {
    passwd = parsePasswd(await fs.readFile(passwdFile, "utf8"))
  } catch {
    // no passwd file: only uid:gid can be resolved
  }
  const numeric = UID_GID.exec(spec)
  if (numeric !== null) {
    const uid = Number(numeric[1])
    const gid = Number(numeric[2])
    const known = passwd.find((user) => user.uid === uid)
    return { name: known?.name ?? `uid${uid}`, uid, gid, home: known?.home ?? "/" }
  }
  const user = passwd.find((entry) => entry.name === spec)
  if (user === undefined) throw new Error(`user ${JSON.stringify(spec)} is not in ${passwdFile}`)
  return user
}

/** Only root can hand processes and files to another user; elsewhere turns run as ourselves. */
export const isRoot = (): boolean => typeof process.getuid === "function" && process.getuid() === 0
