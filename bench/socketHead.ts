import type * as net from "node:net"

/**
 * Reads a socket up to `delimiter` (a tunnel's request or answer line, a CONNECT reply's
 * headers), then stops reading: the socket is paused, the bytes after the delimiter are put back
 * for whoever reads it next, and `onHead` gets the text before the delimiter.
 */
export const readHead = (socket: net.Socket, delimiter: string, onHead: (head: string) => void): void => {
  let head = Buffer.alloc(0)
  const onData = (chunk: Buffer) => {
    head = Buffer.concat([head, chunk])
    const end = head.indexOf(delimiter)
    if (end < 0) return
    socket.off("data", onData)
    socket.pause()
    const rest = head.subarray(end + delimiter.length)
    if (rest.length > 0) socket.unshift(rest)
    onHead(head.subarray(0, end).toString())
  }
  socket.on("data", onData)
}
