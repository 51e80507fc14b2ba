#!/bin/sh
# initrd /init: load the virtio modules (dependency order), mount the ext4 root, switch to it.
# The list ends with the vsock transport (vsock, vmw_vsock_virtio_transport_common,
# vmw_vsock_virtio_transport): the RPC channel under vfkit, where there is no virtio-serial port.
# virtio-rng (the entropy device both VMMs give) feeds the kernel's pool from the host.
# A module that is not in the initrd (built in, or absent from this kernel) is skipped.
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in @MODULES@; do
  [ -f "/lib/modules/$m.ko" ] && insmod "/lib/modules/$m.ko" 2>/dev/null
done
# The console again, now that its driver is loaded: with console=hvc0 (vfkit) the console is
# virtio_console, a module, so /init started with no /dev/console behind its fds and everything
# it and the agent write would be lost. /sbin/init and the agent inherit these fds.
# (hvc0 registers as the driver probes: a short bounded wait)
i=0
while ! { : >/dev/console; } 2>/dev/null && [ $i -lt 100 ]; do i=$((i + 1)); usleep 10000; done
if { : >/dev/console; } 2>/dev/null; then
  exec </dev/console >/dev/console 2>&1
  echo "abox-initrd: console ready"
fi
# /dev/vda appears when virtio_blk has probed; devtmpfs creates the node (an event, not a guess),
# a short bounded wait covers the probe's asynchronous completion.
i=0
while [ ! -b /dev/vda ] && [ $i -lt 500 ]; do i=$((i + 1)); usleep 10000; done
# discard: the guest's deletes free the host's blocks (the drive has discard=unmap), so a session's
# overlay or sparse root keeps only what is still in use
if ! mount -t ext4 -o discard /dev/vda /newroot; then
  echo "abox-initrd: cannot mount /dev/vda" >/dev/console
  poweroff -f
fi
mount --move /dev /newroot/dev
umount /sys /proc
exec switch_root /newroot /sbin/init
