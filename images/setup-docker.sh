#!/usr/bin/env bash
# Make a Docker Engine answer on /var/run/docker.sock, and make sure the tools the image builder
# uses are installed (Debian's docker.io, docker-registry, debootstrap, skopeo), and Prometheus
# (Debian's prometheus: promtool and the server the monitoring test scrapes vLLM with).
#
# On Debian as root: installs what is missing with apt-get and starts
#   dockerd --bridge=none --iptables=false --ip-masq=false
# (no bridge network, ever: every build and container runs with network "none").
# Elsewhere: stops with what to install. Idempotent; prints progress on stderr.
set -euo pipefail
log() { echo "setup-docker: $*" >&2; }
need_pkgs=()
command -v dockerd >/dev/null 2>&1 || need_pkgs+=(docker.io)
command -v docker-registry >/dev/null 2>&1 || need_pkgs+=(docker-registry)
command -v debootstrap >/dev/null 2>&1 || need_pkgs+=(debootstrap)
command -v skopeo >/dev/null 2>&1 || need_pkgs+=(skopeo)
{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || need_pkgs+=(prometheus)

engine_answers() {
  # The SDK's own ping: the same thing build.py asks.
  "${PYTHON:-python3}" - <<'PY' >/dev/null 2>&1
import docker
docker.from_env(timeout=5).ping()
PY
}

if ((${#need_pkgs[@]})); then
  if [[ $(id -u) -ne 0 || ! -r /etc/debian_version ]]; then
    log "missing: ${need_pkgs[*]}; install Debian's packages docker.io docker-registry debootstrap skopeo prometheus (as root: apt-get install ${need_pkgs[*]}), or the equivalents for your system, and start dockerd with --bridge=none --iptables=false --ip-masq=false"
    exit 2
  fi
  log "installing ${need_pkgs[*]} from Debian's packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  # no package starts its service (dockerd, prometheus on every interface): dockerd is started
  # below with its flags, Prometheus only by the test that needs it, on 127.0.0.1
  policy=/usr/sbin/policy-rc.d
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
    chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT  # also when the install fails
  fi
  apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >&2
fi

if engine_answers; then
  log "a Docker Engine answers"
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  log "no Docker Engine answers on ${DOCKER_HOST:-/var/run/docker.sock} and this is not root: start one (dockerd --bridge=none --iptables=false --ip-masq=false) or set DOCKER_HOST"
  exit 2
fi
log_file=${DOCKERD_LOG:-/var/log/sparkcache-dockerd.log}
if ! pgrep -x containerd >/dev/null; then
  log "starting containerd"
  setsid nohup containerd >/var/log/sparkcache-containerd.log 2>&1 < /dev/null &
  sleep 1
fi
log "starting dockerd --bridge=none --iptables=false --ip-masq=false (log: $log_file)"
setsid nohup dockerd --bridge=none --iptables=false --ip-masq=false \
  --containerd=/run/containerd/containerd.sock >"$log_file" 2>&1 < /dev/null &
for _ in $(seq 1 60); do
  if engine_answers; then log "dockerd answers"; exit 0; fi
  sleep 1
done
log "dockerd did not answer within 60 s; see $log_file"
tail -20 "$log_file" >&2 || true
exit 1
