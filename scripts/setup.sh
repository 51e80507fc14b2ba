#!/usr/bin/env bash
# Sets up a fresh Debian machine for abox: system packages (QEMU, image tools), npm packages,
# the bundles, and the default golden image. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

packages=(qemu-system-x86 qemu-utils busybox-static e2fsprogs cpio curl ca-certificates nix-bin eatmydata)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if [ ! -d node_modules ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  npm ci --no-audit --no-fund
fi
npm run build

# The default golden image (kernel from Debian's cloud kernel package, busybox, node, the guest agent).
if ! node dist/abox.js image list --json 2>/dev/null | grep -q '"default":true'; then
  node dist/abox.js image build
fi
