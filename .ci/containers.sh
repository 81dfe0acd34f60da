#!/usr/bin/env bash
# CI's container stage (called by .ci/run inside its venv; runs alone too: `bash .ci/containers.sh`).
#   1. a container engine: podman from Debian with its Docker API socket (containers-engine.sh)
#   2. our images, built without a registry: localhost/kvwire-base:bookworm (debootstrap),
#      localhost/kvwire-kafka:<version> (the Maven-resolved broker jars), localhost/kvwire:dev (Dockerfile)
#   3. integration tests against a broker that testcontainers started from that image
#   4. docker-compose.yml: kafka + index up, the demo profile run, /healthz and /v1/score checked
#      from the host, everything torn down
# Under CI=true a missing engine fails here: nothing in this stage may skip.
# A warm machine keeps the engine, its socket service, the images and the debootstrap tarball.
set -euo pipefail
cd "$(dirname "$0")/.."

elapsed() { awk -v a="$EPOCHREALTIME" -v b="$1" 'BEGIN { printf "%.1f", a - b }'; }
T0=$EPOCHREALTIME
step_start=$T0
step() {
  [[ -n "${step_name:-}" ]] && printf ':::   %-26s %6ss\n' "$step_name" "$(elapsed "$step_start")" >&2
  step_name=$1; step_start=$EPOCHREALTIME
  [[ -n "$step_name" ]] && echo ":::   containers: $step_name ..." >&2
  return 0
}

free_port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

compose_cmd=()
project=kvwire-ci-$$
compose_up=0
finish() {
  local rc=$?
  if [[ $compose_up == 1 ]]; then
    if [[ $rc != 0 ]]; then
      echo "::: compose logs (failure):" >&2
      "${compose_cmd[@]}" logs --tail 80 >&2 2>&1 || true
    fi
    step "compose down"
    "${compose_cmd[@]}" down -v >/dev/null 2>&1 || true
  fi
  step ""
  printf ':::   %-26s %6ss (exit %d)\n' "containers total" "$(elapsed "$T0")" "$rc" >&2
  exit "$rc"
}
trap finish EXIT

step "engine"
# shellcheck source=.ci/containers-engine.sh
. .ci/containers-engine.sh
engine_setup
# .ci/run installs the containers extra with the others; a standalone run brings it here.
command -v podman-compose >/dev/null || python -m pip install -q -e '.[test,containers]'

step "images"
KVWIRE_KAFKA_IMAGE=$(kvwire kafka image | tail -n 1)
export KVWIRE_KAFKA_IMAGE KVWIRE_BASE_IMAGE=localhost/kvwire-base:bookworm KVWIRE_IMAGE=localhost/kvwire:dev
# The app image gets the kvwire wheel of this checkout, built here: cargo reuses the release build
# `pip install -e .` just made, where the Dockerfile's own source build (Debian's Rust toolchain,
# then a full LTO compile) would add minutes to a cold run. Dependencies still come from PyPI.
rm -rf build/docker-wheels
app_log=$(mktemp)
if ! python -m pip wheel -q --no-deps -w build/docker-wheels . >"$app_log" 2>&1; then
  tail -n 60 "$app_log" >&2
  exit 1
fi
if ! "${KVWIRE_ENGINE:-podman}" build --network host --build-arg "BASE=$KVWIRE_BASE_IMAGE" \
  --build-arg KVWIRE_WHEELS=build/docker-wheels -t "$KVWIRE_IMAGE" . >"$app_log" 2>&1; then
  tail -n 60 "$app_log" >&2
  exit 1
fi
rm -f "$app_log"
echo "::: broker image $KVWIRE_KAFKA_IMAGE, app image $KVWIRE_IMAGE" >&2
engine_dns_check "$KVWIRE_BASE_IMAGE"
# Superseded builds pile up on a warm machine; recent ones stay as the layer cache.
"${KVWIRE_ENGINE:-podman}" image prune -f --filter until=48h >/dev/null 2>&1 || true

step "testcontainers pytest"
# The session broker is a testcontainer (tests/tc_broker.py), not the host's broker.
(
  unset KAFKA_BOOTSTRAP_SERVERS
  export KVWIRE_TEST_BROKER=testcontainers CI="${CI:-true}"
  # Replay and digest (the snapshot/replay equality cases), the container tests and tail. The long
  # workload case that compares with the simulator runs in the main stage only, to keep this short.
  python -m pytest -q -p no:cacheprovider \
    tests/consumer/test_oracle_through_kafka.py \
    tests/consumer/test_replay.py -k "not test_live_full_replay_and_snapshot_tail_agree" \
    tests/containers \
    tests/cli/test_tail.py
)

step "compose up"
if [[ ${KVWIRE_ENGINE:-} == docker ]] && docker compose version >/dev/null 2>&1; then
  compose_cmd=(docker compose)
else
  compose_cmd=(podman-compose)
fi
KVWIRE_KAFKA_HOST_PORT=$(free_port)
KVWIRE_INDEX_HOST_PORT=$(free_port)
export KVWIRE_KAFKA_HOST_PORT KVWIRE_INDEX_HOST_PORT
compose_cmd+=(-p "$project" -f docker-compose.yml)
compose_up=1
"${compose_cmd[@]}" up -d kafka index >/dev/null

step "compose demo"
# The demo profile, shortened: it exits non-zero when any routing decision disagrees with its oracle.
"${compose_cmd[@]}" --profile demo run --rm -T demo demo --bootstrap-servers kafka:9092 --seconds 6 --workers 4 --members 1

step "compose score"
python .ci/compose_check.py "127.0.0.1:$KVWIRE_KAFKA_HOST_PORT" "http://127.0.0.1:$KVWIRE_INDEX_HOST_PORT"
