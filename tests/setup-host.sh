#!/usr/bin/env bash
# What the host suite needs beyond the venv and Docker: Debian's libfuse2 (fusepy's libfuse, for
# the FUSE filesystem that fails on demand, tests/faultfs.py) and a /dev/fuse to mount it with.
# On Debian as root: installs what is missing with apt-get. Elsewhere: stops with what to install.
# Idempotent; prints progress on stderr.
set -euo pipefail
log() { echo "setup-host: $*" >&2; }
if ! ldconfig -p | grep -q 'libfuse\.so\.2'; then
  if [[ $(id -u) -ne 0 || ! -r /etc/debian_version ]]; then
    log "missing: libfuse2; install Debian's package libfuse2 (as root: apt-get install libfuse2) or your system's libfuse 2"
    exit 2
  fi
  log "installing libfuse2 from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends libfuse2 >&2
fi
if [[ ! -c /dev/fuse ]]; then
  log "no /dev/fuse: load the fuse module (modprobe fuse) or give the container --device /dev/fuse"
  exit 2
fi
