/**
 * Guest-opened broker tunnels (protocol v4): the CONNECT proxy asks for `host:port`, this sends
 * `tunnel_open` on a fresh odd channel id and waits for the host's `tunnel_accept` or
 * `tunnel_deny`; an accepted tunnel is the mux channel wrapped as a Node Duplex for the proxy to
 * pipe. Closing either side sends `tunnel_close`.
 */
import { Duplex } from "node:stream"
import type { ControlMessage } from "../protocol/Messages.js"
import type { MuxChannel } from "../protocol/Mux.js"
import type { AgentLink } from "./agent.js"
import type { TunnelOpenResult } from "./connectProxy.js"
import { errorMessage } from "../domain/errorMessage.js"

/** a mux channel as a Duplex: reads follow the channel's credit, writes wait for it */
export const channelDuplex = (channel: MuxChannel, onDestroy: () => void): Duplex => {
  let started = false
  let wake: (() => void) | undefined
  const resume = () => {
    const resolve = wake
    wake = undefined
    resolve?.()
  }
  const duplex: Duplex = new Duplex({
    read() {
      if (started) return resume()
      started = true
      void (async () => {
        try {
          for await (const chunk of channel.readable) {
            if (duplex.destroyed) return
            if (!duplex.push(chunk)) await new Promise<void>((resolve) => (wake = resolve))
          }
          duplex.push(null)
        } catch (error) {
          duplex.destroy(error instanceof Error ? error : new Error(String(error), { cause: error }))
        }
      })()
    },
    write(chunk: Buffer, _encoding, callback) {
      channel.write(chunk).then(
        () => callback(),
        (error: unknown) => callback(error instanceof Error ? error : new Error(String(error), { cause: error }))
      )
    },
    final(callback) {
      channel.end().then(
        () => callback(),
        (error: unknown) => callback(error instanceof Error ? error : new Error(String(error), { cause: error }))
      )
    },
    destroy(error, callback) {
      resume()
      onDestroy()
      callback(error)
    }
  })
  return duplex
}

/**
 * Tunnels this guest holds at once (waiting for the host's answer, or open); more CONNECTs are
 * refused here. Below the host's bound on a guest's live channels (512), which it treats as a
 * protocol error: a busy proxy is told no, the connection never breaks.
 */
export const MAX_TUNNELS = 256

interface Pending {
  readonly resolve: (result: TunnelOpenResult) => void
}

export class TunnelClient {
  private nextChannel = 1
  private readonly pending = new Map<number, Pending>()
  private readonly open = new Set<number>()
  private closed = false

  constructor(
    private readonly link: AgentLink,
    private readonly log: (line: string) => void
  ) {}

  /** the proxy's `openTunnel` */
  request(host: string, port: number): Promise<TunnelOpenResult> {
    if (this.closed) return Promise.resolve({ ok: false, reason: "the agent is shutting down" })
    if (this.pending.size + this.open.size >= MAX_TUNNELS) {
      return Promise.resolve({ ok: false, reason: `too many tunnels (${MAX_TUNNELS}) open at once` })
    }
    const id = this.nextChannel
    this.nextChannel += 2
    // the local end exists before the host can send on it
    this.link.channel(id)
    return new Promise<TunnelOpenResult>((resolve) => {
      this.pending.set(id, { resolve })
      this.link.sendControl({ type: "tunnel_open", channel: id, host, port }).catch((error: unknown) => {
        this.pending.delete(id)
        resolve({
          ok: false,
          reason: `cannot reach the host: ${errorMessage(error)}`
        })
      })
    })
  }

  /** tunnel_accept / tunnel_deny / tunnel_close from the host */
  onMessage(message: ControlMessage): void {
    if (message.type !== "tunnel_accept" && message.type !== "tunnel_deny" && message.type !== "tunnel_close")
      return
    const id = message.channel
    const waiting = this.pending.get(id)
    this.pending.delete(id)
    if (message.type === "tunnel_accept") {
      if (waiting === undefined) return
      this.open.add(id)
      const stream = channelDuplex(this.link.channel(id), () => this.release(id))
      waiting.resolve({ ok: true, stream })
      return
    }
    if (message.type === "tunnel_deny") {
      this.log(`tunnel ${id} denied: ${message.reason}`)
      this.link.channel(id).destroy("denied")
      waiting?.resolve({ ok: false, reason: message.reason })
      return
    }
    // tunnel_close: the mux has dropped the channel; a reader or writer of it fails and closes
    this.open.delete(id)
    waiting?.resolve({ ok: false, reason: "the host closed the tunnel" })
  }

  private release(id: number): void {
    if (!this.open.delete(id)) return
    this.link.sendControl({ type: "tunnel_close", channel: id }).catch(() => undefined)
  }

  /** shutdown / disconnect: every waiting CONNECT is refused */
  close(): void {
    this.closed = true
    for (const waiting of this.pending.values())
      waiting.resolve({ ok: false, reason: "the agent is shutting down" })
    this.pending.clear()
  }
}
