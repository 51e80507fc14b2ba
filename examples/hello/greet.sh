#!/bin/sh
# Prints where it runs: inside the session this is the guest's kernel, not the host's.
echo "hello from $(uname -n), kernel $(uname -r), as $(id -un) in $(pwd)"
