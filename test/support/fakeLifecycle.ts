/**
 * The fake lifecycle every program test runs on: the real store, lock, guest RPC and broker
 * over FakeVmm (the guest agent as a host process) and FakeImages, at one ABOX_HOME. One
 * definition, so the program tests build the same layer.
 */
import * as NodeCommandExecutor from "@effect/platform-node/NodeCommandExecutor"
import * as NodeFileSystem from "@effect/platform-node/NodeFileSystem"
import * as Layer from "effect/Layer"
import { HttpsBrokerLive } from "../../src/broker/HttpsBrokerLive.js"
import * as FakeVmm from "../../src/layers/FakeVmm.js"
import { GuestRpcLive } from "../../src/layers/guestRpc/index.js"
import { FakeImages } from "../../src/layers/Lifecycle.js"
import { RuntimeLockLive } from "../../src/layers/RuntimeLockLive.js"
import { SessionStoreLive } from "../../src/layers/SessionStoreLive.js"
import { aboxPathsAt } from "../../src/services/AboxPaths.js"

/** the fake lifecycle at `home`; `vmm` and `broker` replace FakeVmm.layer and HttpsBrokerLive */
export const fakeLifecycle = (
  home: string,
  options: {
    readonly vmm?: typeof FakeVmm.layer
    readonly broker?: typeof HttpsBrokerLive
  } = {}
) =>
  Layer.mergeAll(
    SessionStoreLive,
    RuntimeLockLive,
    GuestRpcLive,
    options.broker ?? HttpsBrokerLive,
    options.vmm ?? FakeVmm.layer,
    FakeImages
  ).pipe(
    Layer.provideMerge(aboxPathsAt(home)),
    Layer.provideMerge(NodeCommandExecutor.layer),
    Layer.provideMerge(NodeFileSystem.layer)
  )
