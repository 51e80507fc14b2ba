import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as fs from "node:fs/promises"
import * as path from "node:path"
import { CACHE_FILES, sessionFile } from "../domain/sessionLayout.js"
import { backendEnv } from "../lib/env.js"
import { ImagesLive } from "./ImagesLive.js"
import { PROTOCOL_VERSION } from "../protocol/Messages.js"
import { hostArch } from "../lib/arch.js"
import { AboxPaths } from "../services/AboxPaths.js"
import { Images } from "../services/Images.js"
import { DiskError } from "../domain/image.js"
import * as FakeVmm from "./FakeVmm.js"
import { GuestRpcLive } from "./guestRpc/index.js"
import { HttpsBrokerLive } from "../broker/HttpsBrokerLive.js"
import { DarwinVmmLive } from "./DarwinVmm.js"
import { QemuVmmLive } from "./QemuVmm.js"
import { RuntimeLockLive } from "./RuntimeLockLive.js"

export const FakeImages = Layer.succeed(Images, {
  resolve: () =>
    Effect.succeed({
      identity: { name: "fake", digest: "0".repeat(64) },
      arch: hostArch(),
      protocol: PROTOCOL_VERSION,
      kernel: "",
      initrd: "",
      rootDisk: ""
    }),
  // an empty root.raw: the fake guest keeps its state there (src/layers/FakeVmm.ts)
  cloneRoot: (image, dir) => {
    const target = sessionFile(dir, "rootDisk")
    return Effect.tryPromise({
      try: () => fs.writeFile(target, "", { mode: 0o600, flag: "wx" }),
      catch: (cause) =>
        new DiskError({
          path: target,
          reason: "create",
          message: `cannot create ${target}: ${String(cause)}`
        })
    }).pipe(
      Effect.as({
        file: target,
        info: { format: "raw", kind: "copy", backing: image.identity.digest } as const
      })
    )
  }
})

const backends = Layer.unwrapEffect(
  Effect.gen(function* () {
    const env = yield* backendEnv
    if (env.backend === "fake") return Layer.merge(FakeVmm.layer, FakeImages)
    const paths = yield* AboxPaths
    const images = ImagesLive.pipe(Layer.provide(NodeCommandExecutor.layer))
    const vmm =
      env.backend === "vz"
        ? DarwinVmmLive({ vfkit: env.vfkit })
        : QemuVmmLive({
            accel: env.accel,
            accelCache: path.join(paths.homeFile("cache"), CACHE_FILES.accel)
          })
    return Layer.merge(vmm, images)
  })
)

/** What Open, Resume, Turn and Close need beyond the store: lock, VMM, guest RPC, broker, images. */
export const LifecycleLive = Layer.mergeAll(RuntimeLockLive, GuestRpcLive, HttpsBrokerLive, backends)
