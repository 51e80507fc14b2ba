#!/bin/sh
# /sbin/init of the golden root: minimal mounts, one console line, then the guest agent.
# The agent's defaults: config /dev/vdb, rpc = the virtio-serial port named abox.rpc,
# state /var/lib/abox, repo /work/repo, user agent, on shutdown: poweroff.
# The agent starts from its V8 startup snapshot (/opt/abox/agent.blob, see agent-snapshot.sh)
# when the image has one; a blob node rejects (it exits non-zero, or dies, before the agent's first
# step, which creates /run/abox-agent.started) falls back to the plain bundle: never a dead boot.
export PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin
export HOME=/root
# the agent's own node: /opt/abox/bin/node when the image has one apart from the turns' node
# (the workstation), else the one on PATH
AGENT_NODE=/opt/abox/bin/node
[ -x "$AGENT_NODE" ] || AGENT_NODE=node
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
# turn processes need neither ptrace nor user namespaces: only CAP_SYS_PTRACE may attach, and no
# namespace can be made (user.max_user_namespaces; Debian kernels also have the older switch)
for setting in kernel/yama/ptrace_scope=2 user/max_user_namespaces=0 kernel/unprivileged_userns_clone=0; do
  key=${setting%%=*}
  if [ -e "/proc/sys/$key" ]; then
    echo "${setting#*=}" > "/proc/sys/$key" || echo "abox-init: cannot set $key"
  fi
done
# `abox image build` boots a new image once with abox.snapshot=build: the agent's startup snapshot
# is built here, by this node on this (virtual) CPU, then the VM powers off
case " $(cat /proc/cmdline) " in
  *" abox.snapshot=build "*)
    if sh /opt/abox/agent-snapshot.sh "$(command -v "$AGENT_NODE")" /opt/abox/abox-guest-snapshot.cjs /opt/abox/agent.blob; then
      echo "abox-init: agent snapshot built"
    else
      echo "abox-init: agent snapshot not built"
    fi
    # a clean file system for the golden image: no journal left to replay at every session's boot
    sync
    mount -o remount,ro / || echo "abox-init: cannot remount / read-only"
    poweroff -f
    ;;
esac
if [ -x /opt/abox/init-hook ]; then /opt/abox/init-hook; fi
# the agent reads its virtio port on the libuv thread pool (see src/guest/rpcPort.ts)
export UV_THREADPOOL_SIZE=8
status=
if [ -f /opt/abox/agent.blob ]; then
  "$AGENT_NODE" --snapshot-blob /opt/abox/agent.blob
  status=$?
  if [ "$status" -ne 0 ] && [ ! -e /run/abox-agent.started ]; then
    echo "abox-init: the agent snapshot did not start ($status): starting the bundle"
    status=
  fi
fi
if [ -z "$status" ]; then
  "$AGENT_NODE" /opt/abox/abox-guest.js
  status=$?
fi
echo "abox-init: agent exited ($status)"
sync
poweroff -f
