#!/usr/bin/env bash
# Sets up a fresh Debian machine for abox: system packages (QEMU, image tools), npm packages,
# the bundles, and the default golden image. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

packages=(qemu-system-x86 qemu-utils zstd busybox-static e2fsprogs cpio curl ca-certificates nix-bin eatmydata debootstrap bsdutils)
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

# The default golden image: the workstation (`abox image build --variant full`: a Debian root with
# bash, git, curl, wget, make, build-essential, python3, ripgrep, jq, Node 24 with npm, ...; see
# images/build-full.sh). Content-addressed: kept while the default image is a workstation holding
# this checkout's guest agent (image.json's `agent` is the bundle's sha256), rebuilt otherwise.
default_is_workstation() {
  node dist/abox.js image list --json 2>/dev/null | node -e '
    const { createHash } = require("node:crypto")
    const agent = createHash("sha256").update(require("node:fs").readFileSync("dist/abox-guest.js")).digest("hex")
    let text = ""
    process.stdin.on("data", (chunk) => (text += chunk)).on("end", () => {
      let list
      try { list = JSON.parse(text) } catch { process.exit(1) }
      const images = Array.isArray(list?.images) ? list.images : []
      process.exit(images.some((i) => i?.default === true && i?.variant === "full" && i?.agent === agent) ? 0 : 1)
    })'
}
if default_is_workstation; then
  echo "setup: the default image is the workstation (abox image list)"
else
  node dist/abox.js image build --variant full
fi
