#!/bin/sh
# Builds the guest agent's V8 startup snapshot for an image root, with the guest's own node.
#
# usage: agent-snapshot.sh GUEST_NODE ENTRY ARCH BLOB
#   GUEST_NODE  the node binary the image ships (V8 accepts a blob only in the binary that built it)
#   ENTRY       dist/abox-guest-snapshot.cjs (src/guest/snapshot.ts bundled as CommonJS)
#   ARCH        the guest arch (x86_64|aarch64): the build host must be able to run GUEST_NODE
#   BLOB        where to write the blob (e.g. <root>/opt/abox/agent.blob)
# Prints `snapshot` when BLOB was written and checked, `bundle` (and why, on stderr) when not:
# an image without a blob starts the plain bundle, which is always there.
set -u
NODE_BIN=$1
ENTRY=$2
ARCH=$3
BLOB=$4
no_snapshot() {
  echo "agent-snapshot: no snapshot, the image starts the plain bundle: $1" >&2
  rm -f "$BLOB"
  echo bundle
  exit 0
}
[ -f "$ENTRY" ] || no_snapshot "$ENTRY not found"
ENTRY=$(cd "$(dirname "$ENTRY")" && pwd)/$(basename "$ENTRY")
[ "$(uname -m)" = "$ARCH" ] || no_snapshot "a $ARCH node cannot run on this $(uname -m) build host"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# a clean environment and working directory: nothing of the build host's is worth capturing
if ! (cd "$TMP" && env -i PATH=/usr/bin:/bin "$NODE_BIN" --snapshot-blob "$TMP/agent.blob" \
  --build-snapshot "$ENTRY" >"$TMP/build.log" 2>&1); then
  cat "$TMP/build.log" >&2
  no_snapshot "node --build-snapshot failed"
fi
# check: deserialise it once; `-- --help` prints the agent's usage and exits before touching anything
if ! (cd "$TMP" && env -i PATH=/usr/bin:/bin "$NODE_BIN" --snapshot-blob "$TMP/agent.blob" -- --help 2>&1) |
  grep -q '^usage: abox-guest'; then
  no_snapshot "the blob did not start the agent"
fi
cp "$TMP/agent.blob" "$BLOB"
chmod 0644 "$BLOB"
echo "agent-snapshot: $(($(wc -c <"$BLOB") / 1024)) KiB, built by node $("$NODE_BIN" --version)" >&2
echo snapshot
