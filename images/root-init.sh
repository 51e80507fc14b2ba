#!/bin/sh
# /sbin/init of the golden root: minimal mounts, one console line, then the guest agent.
# The agent's defaults: config /dev/vdb, rpc = the virtio-serial port named abox.rpc,
# state /var/lib/abox, repo /work/repo, user agent, on shutdown: poweroff.
export PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin
export HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
grep -q ' /dev ' /proc/mounts || mount -t devtmpfs devtmpfs /dev
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /tmp
mkdir -p /dev/pts /run
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /run
hostname "$(cat /etc/hostname 2>/dev/null || echo abox)"
ip link set lo up 2>/dev/null
echo "abox-init: started"
if [ -x /opt/abox/init-hook ]; then /opt/abox/init-hook; fi
node /opt/abox/abox-guest.js
echo "abox-init: agent exited ($?)"
sync
poweroff -f
