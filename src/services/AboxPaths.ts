import * as Config from "effect/Config"
import * as Context from "effect/Context"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as os from "node:os"
import * as path from "node:path"
import { HOME_FILES, type HomeFile, LEGACY_SESSIONS } from "../domain/sessionLayout.js"

/**
 * Where abox keeps its state. `ABOX_HOME` overrides `~/.abox`. The legacy home
 * (`~/Library/Application Support/ABox`, older macOS versions) is looked for on every OS:
 * home directories move between machines, and it costs one stat when absent.
 */
export interface AboxPathsShape {
  readonly home: string
  readonly sessions: string
  readonly names: string
  readonly images: string
  readonly legacySessions: string
  /** the session directory of `id` in the current home (SessionStore locates a session in either home) */
  readonly sessionDir: (id: string) => string
  /** `$ABOX_HOME/<file>` for the home's own files (src/domain/sessionLayout.ts) */
  readonly homeFile: (file: HomeFile) => string
}

export class AboxPaths extends Context.Tag("abox/AboxPaths")<AboxPaths, AboxPathsShape>() {}

export const makeAboxPaths = (home: string, userHome: string): AboxPathsShape => {
  const sessions = path.join(home, HOME_FILES.sessions)
  return {
    home,
    sessions,
    names: path.join(home, HOME_FILES.names),
    images: path.join(home, HOME_FILES.images),
    legacySessions: path.join(userHome, ...LEGACY_SESSIONS),
    sessionDir: (id) => path.join(sessions, id),
    homeFile: (file) => path.join(home, HOME_FILES[file])
  }
}

/** Reads `ABOX_HOME` and `HOME` through Config, so tests use `ConfigProvider.fromMap`. */
export const AboxPathsLive = Layer.effect(
  AboxPaths,
  Effect.gen(function* () {
    const userHome = yield* Config.string("HOME").pipe(Config.withDefault(os.homedir()))
    const home = yield* Config.option(Config.string("ABOX_HOME"))
    return makeAboxPaths(path.resolve(Option.getOrElse(home, () => path.join(userHome, ".abox"))), userHome)
  })
)

export const aboxPathsAt = (home: string, userHome: string = home) =>
  Layer.succeed(AboxPaths, makeAboxPaths(path.resolve(home), userHome))
