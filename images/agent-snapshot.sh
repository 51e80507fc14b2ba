#!/bin/sh
# Builds the guest agent's V8 startup snapshot: run by the image's own init inside the image's
# first boot (kernel argument abox.snapshot=build, see root-init.sh and `abox image build`).
#
# Why inside the guest: node accepts a blob only in the binary that built it *and* with the same
# V8 configuration, which includes the CPU features V8 detects (e.g. the host's CET shadow stack
# or AVX-512 against QEMU's emulated `-cpu max`). The image's first boot runs on the CPU model its
# sessions will see, so the blob built there is the one they accept.
#
# usage: agent-snapshot.sh NODE ENTRY BLOB
#   NODE   the image's node binary
#   ENTRY  the agent's snapshot entry (src/guest/snapshot.ts bundled as CommonJS)
#   BLOB   where to write the blob (/opt/abox/agent.blob)
# Exits 0 when BLOB was written and checked (deserialised once: `-- --help` prints the agent's
# usage and exits before touching anything); non-zero, without a BLOB, otherwise: the image then
# starts the plain bundle, which is always there.
set -u
NODE_BIN=$1
ENTRY=$2
BLOB=$3
fail() {
  echo "agent-snapshot: no snapshot: $1" >&2
  rm -f "$BLOB"
  exit 1
}
[ -f "$ENTRY" ] || fail "$ENTRY not found"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# a clean environment and working directory: nothing of the build's is worth capturing
if ! (cd "$TMP" && env -i PATH=/usr/bin:/bin "$NODE_BIN" --snapshot-blob "$TMP/agent.blob" \
  --build-snapshot "$ENTRY" >"$TMP/build.log" 2>&1); then
  cat "$TMP/build.log" >&2
  fail "node --build-snapshot failed"
fi
if ! (cd "$TMP" && env -i PATH=/usr/bin:/bin "$NODE_BIN" --snapshot-blob "$TMP/agent.blob" -- --help 2>&1) |
  grep -q '^usage: abox-guest'; then
  fail "the blob did not start the agent"
fi
cp "$TMP/agent.blob" "$BLOB"
chmod 0644 "$BLOB"
echo "agent-snapshot: $(($(wc -c <"$BLOB") / 1024)) KiB, built by node $("$NODE_BIN" --version)" >&2
