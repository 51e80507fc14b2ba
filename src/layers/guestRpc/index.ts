/**
 * The host side of protocol v4 (docs/protocol.md), one file per concern:
 * - listener.ts: binds rpc.sock and hands out the VMM's connection;
 * - MuxAdapter.ts: the Effect view of the Mux (control Stream, channels with a Scope);
 * - dispatcher.ts: routes the guest's control messages to what waits for them;
 * - connection.ts: handshake and the operations of one connection:
 *   turns.ts, transfers.ts (in and out), shutdown.ts, tunnels.ts (tunnels and port forwards).
 */
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import { GuestRpc, type GuestRpcOptions } from "../../services/GuestRpc.js"
import { connect } from "./connection.js"
import { bindListener, nextConnection } from "./listener.js"

export { checkGuestProtocol, MAX_GUEST_CHANNELS } from "./connection.js"
export { DEFAULT_TRANSFER_END_TIMEOUT } from "./transfers.js"

export const GuestRpcLive = Layer.succeed(GuestRpc, {
  listen: Effect.fn("GuestRpc.listen")(function* (socketPath: string, options: GuestRpcOptions) {
    const connections = yield* bindListener(socketPath)
    const accept = Effect.flatMap(nextConnection(connections, options.helloTimeout), (socket) =>
      connect(socket, options)
    ).pipe(Effect.withSpan("GuestRpc.accept"))
    return { accept }
  })
})
