import { env } from "./commands/env.js"
import { image } from "./commands/image.js"
import { list } from "./commands/list.js"
import { name } from "./commands/name.js"
import { prune } from "./commands/prune.js"
import { rm } from "./commands/rm.js"
import { doctorCommand, gcCommand, logs } from "./commands/maintenance.js"
import { scrub } from "./commands/scrub.js"
import { applyCommand, cpCommand, diffCommand } from "./commands/repo.js"
import { openCommand, resumeCommand, run } from "./commands/session.js"
import { show } from "./commands/show.js"
import {
  attachCommand,
  execCommand,
  forwardCommand,
  startCommand,
  stopCommand,
  superviseCommand,
  suspendCommand
} from "./commands/detached.js"
import { aboxCommand, runAbox } from "./root.js"

/** every `abox` subcommand: a new one is an import above and one entry here */
const subcommands = [
  openCommand,
  run,
  resumeCommand,
  list,
  show,
  logs,
  name,
  rm,
  prune,
  gcCommand,
  scrub,
  doctorCommand,
  image,
  env,
  diffCommand,
  applyCommand,
  cpCommand,
  startCommand,
  execCommand,
  attachCommand,
  stopCommand,
  suspendCommand,
  forwardCommand,
  superviseCommand
] as const

export const abox = aboxCommand(subcommands)

export const cli = runAbox(abox)
