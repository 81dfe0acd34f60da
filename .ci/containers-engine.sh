#!/usr/bin/env bash
# Sourced by .ci/containers.sh: a container engine with a Docker API socket, set up idempotently.
# A fresh machine has no engine: podman from Debian, rootful, daemonless, with its Docker-compatible
# API served on a socket so testcontainers and docker-py find it through DOCKER_HOST.

PODMAN_SOCK=/run/podman/podman.sock
# Compose services find each other by name (index -> kafka:9092). Debian bookworm's podman 4.3
# networks through CNI, whose plugins package resolves no names: the dnsname plugin does. Without
# it a fresh machine's compose stage waited 180 s for kafka:9092 and gave up.
ENGINE_PACKAGES=(podman containernetworking-plugins golang-github-containernetworking-plugin-dnsname
  runc fuse-overlayfs slirp4netns passt uidmap buildah debootstrap curl)

engine_install() {
  local missing=()
  for p in "${ENGINE_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "::: apt-get install ${missing[*]}" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # Two of podman's defaults fail on these VMs: root lacks CAP_SYS_RESOURCE, so the default
  # nofile/nproc ulimits cannot be set; Debian's crun 1.8 refuses the hybrid cgroup layout where
  # runc copes. No systemd: cgroupfs and a file events log.
  mkdir -p /etc/containers
  local conf=/etc/containers/containers.conf
  local want='# written by kvwire .ci/containers-engine.sh
[containers]
default_ulimits = ["nofile=16384:16384", "nproc=16384:16384"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
[network]
network_backend = "cni"'
  if [[ ! -f $conf ]] || ! cmp -s <(printf '%s\n' "$want") "$conf"; then
    if [[ -f $conf ]] && ! grep -q "written by kvwire" "$conf"; then
      cp "$conf" "$conf.before-kvwire"
    fi
    printf '%s\n' "$want" >"$conf"
  fi
}

engine_socket() {
  # The Docker API (v1.41) over podman: testcontainers, docker-py and podman-compose talk to it.
  # A service left by an earlier run is replaced: after a run's worth of containers one was seen
  # answering pings but failing every container start ("write child: broken pipe"), and a fresh
  # one costs about a second.
  pkill -f "podman system service .*unix://$PODMAN_SOCK" 2>/dev/null && sleep 1
  mkdir -p "$(dirname "$PODMAN_SOCK")"
  rm -f "$PODMAN_SOCK"
  # --time=0: never exits on idle; setsid: outlives this script (compose runs after pytest).
  setsid nohup podman system service --time=0 "unix://$PODMAN_SOCK" >/var/log/kvwire-podman-service.log 2>&1 </dev/null &
  for _ in $(seq 1 100); do
    curl -fsS --unix-socket "$PODMAN_SOCK" http://d/_ping >/dev/null 2>&1 && break
    sleep 0.1
  done
  curl -fsS --unix-socket "$PODMAN_SOCK" http://d/_ping >/dev/null
  export DOCKER_HOST="unix://$PODMAN_SOCK"
  # Ryuk would be pulled from a registry; the fixtures remove their own containers instead.
  export TESTCONTAINERS_RYUK_DISABLED=true
  # These VMs have a /.dockerenv, so testcontainers would think it runs inside a container and
  # look up its own container's gateway (KeyError: 'HostConfig'); ports are published on the host.
  export TESTCONTAINERS_CONNECTION_MODE=docker_host
}

engine_setup() {
  if command -v docker >/dev/null && docker info >/dev/null 2>&1 && ! docker version 2>/dev/null | grep -qi podman; then
    # A real Docker engine answers already (a developer's box): use it as it is.
    echo "::: container engine: docker" >&2
    export KVWIRE_ENGINE=docker
    export TESTCONTAINERS_RYUK_DISABLED="${TESTCONTAINERS_RYUK_DISABLED:-true}"
    return 0
  fi
  engine_install
  engine_socket
  export KVWIRE_ENGINE=podman
  echo "::: container engine: $(podman --version), API on $DOCKER_HOST" >&2
}

engine_dns_check() {
  # Proves what compose relies on before compose needs it: a container finds another one on the
  # same user network by its network alias (as index finds kafka). Fails at once with the reason.
  local image=$1 engine=${KVWIRE_ENGINE:-podman} net="kvwire-dnscheck-$$" out rc
  "$engine" network rm -f "$net" >/dev/null 2>&1 || true
  "$engine" network create "$net" >/dev/null
  "$engine" run -d --rm --name "$net-peer" --network "$net" --network-alias peer "$image" sleep 60 >/dev/null
  # `&& rc=0 || rc=$?`: under the caller's set -e a bare failing assignment would exit unexplained.
  out=$("$engine" run --rm --network "$net" "$image" sh -c 'for i in 1 2 3 4 5 6 7 8 9 10; do getent hosts peer && exit 0; sleep 0.5; done; exit 1' 2>&1) && rc=0 || rc=$?
  "$engine" rm -f "$net-peer" >/dev/null 2>&1 || true
  "$engine" network rm -f "$net" >/dev/null 2>&1 || true
  if ((rc != 0)); then
    echo "::: container name resolution FAILED: a container on network $net cannot resolve its peer by alias" >&2
    echo "::: (compose's index would wait for kafka:9092 and give up). Engine networking:" >&2
    "$engine" info --format '{{.Host.NetworkBackend}}' >&2 2>/dev/null || true
    ls /usr/lib/cni >&2 2>/dev/null || true
    echo "$out" | tail -n 5 >&2
    return 1
  fi
  echo "::: container name resolution: ok (peer -> $(echo "$out" | awk 'NR==1 {print $1}'))" >&2
}
