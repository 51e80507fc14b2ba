import * as Effect from "effect/Effect"
import * as Schema from "effect/Schema"
import * as Stream from "effect/Stream"
import type { Stats } from "node:fs"
import * as fs from "node:fs/promises"
import * as path from "node:path"
import * as tar from "tar"
import { TransferFailed } from "../services/GuestRpc.js"

export class SourceInvalid extends Schema.TaggedError<SourceInvalid>()("SourceInvalid", {
  path: Schema.String,
  message: Schema.String
}) {}

export interface Snapshot {
  /** the tar stream of the tree: regular files, directories and symlinks (as links) */
  readonly tar: Stream.Stream<Uint8Array, TransferFailed>
  /** entries left out (sockets, fifos, devices), relative to the source; filled as the stream runs */
  readonly skipped: ReadonlyArray<string>
}

const kept = (stat: Stats): boolean => stat.isFile() || stat.isDirectory() || stat.isSymbolicLink()

/**
 * An exact snapshot of `source` as a tar stream: files with their modes, directories, and
 * symlinks stored as links — never followed, so nothing outside the tree is read. Sockets,
 * fifos and devices are skipped and named in `skipped`.
 */
export const snapshotSource = Effect.fn("snapshotSource")(function* (source: string) {
  const root = path.resolve(source)
  const stat = yield* Effect.tryPromise({
    try: () => fs.stat(root),
    catch: (cause) =>
      new SourceInvalid({
        path: root,
        message:
          (cause as { code?: unknown }).code === "ENOENT"
            ? `source ${root} does not exist`
            : `cannot read source directory ${root}: ${String(cause)}`
      })
  })
  if (!stat.isDirectory()) {
    return yield* new SourceInvalid({ path: root, message: `source ${root} is not a directory` })
  }
  const skipped: Array<string> = []
  const tarStream = Stream.suspend(() =>
    Stream.fromAsyncIterable(
      tar.c(
        {
          cwd: root,
          follow: false,
          portable: true,
          filter: (entryPath: string, entry: Stats | tar.ReadEntry) => {
            if (
              "isSymbolicLink" in entry &&
              typeof entry.isSymbolicLink === "function" &&
              !kept(entry as Stats)
            ) {
              skipped.push(entryPath)
              return false
            }
            return true
          }
        },
        ["."]
      ) as AsyncIterable<Uint8Array>,
      (cause) =>
        new TransferFailed({ reason: "snapshot", message: `snapshot of ${root} failed: ${String(cause)}` })
    )
  )
  return { tar: tarStream, skipped } satisfies Snapshot
})
