/**
 * A scripted guest over a real unix socket that lists FEATURE_OUTPUT (a shell turn's output on a
 * channel of its own) and answers each `user_turn` with the test's `onTurn`; `cancel` ends the
 * turn as cancelled, `shutdown` closes the connection.
 */
import * as net from "node:net"
import { type ControlMessage, FEATURE_OUTPUT } from "../../src/protocol/Messages.js"
import { Mux } from "../../src/protocol/Mux.js"

export const outputGuest = (
  path: string,
  onTurn: (mux: Mux, message: Extract<ControlMessage, { type: "user_turn" }>) => Promise<void>
): Promise<Mux> =>
  new Promise((resolve, reject) => {
    const socket = net.connect(path)
    socket.once("error", reject)
    socket.once("connect", () => {
      const mux = new Mux(socket)
      mux.onControl((m) => {
        if (m.type === "shutdown") return mux.close()
        if (m.type === "cancel") {
          return mux.sendControl({
            type: "turn_end",
            turn: m.turn,
            exitCode: null,
            signal: "SIGTERM",
            cancelled: true
          })
        }
        // a turn cut short by the host's close is not the test's failure
        if (m.type === "user_turn") onTurn(mux, m).catch(() => undefined)
      })
      mux.onError(() => undefined)
      void mux.sendControl({
        type: "hello",
        protocol: 4,
        arch: "x86_64",
        build: "fake",
        contextTurns: 0,
        features: [FEATURE_OUTPUT]
      })
      void mux.sendControl({ type: "ready" })
      resolve(mux)
    })
  })
