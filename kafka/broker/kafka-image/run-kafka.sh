#!/bin/sh
# Writes server.properties from KAFKA_* variables, formats KRaft storage on first start, then
# becomes the broker (exec: SIGTERM from `stop` reaches the JVM, which shuts down cleanly).
# Same convention as the apache/kafka image, so docker-compose.yml configures either one:
# KAFKA_FOO_BAR=v -> foo.bar=v, with __ -> _ and ___ -> -. With no KAFKA_* setting at all, a
# single-node default listening on 9092 (advertised as localhost:9092).
set -eu
cp="/opt/kafka/libs/*"
jsa=/opt/kafka/kafka.jsa
jvm="-XX:+UseG1GC -XX:ParallelGCThreads=2 -XX:ConcGCThreads=1"

# 22 characters of urlsafe base64 of 16 random bytes, the form Kafka's Uuid takes. About 1 id in 64
# starts with "-"; Kafka's own random-uuid draws again then, because a command line reads such an id
# as an option ("--cluster-id/-t: expected one argument"). We draw again too, and pass the id as
# --cluster-id=ID as well, so an id handed in through CLUSTER_ID cannot be misread either.
new_cluster_id() {
  while :; do
    id=$(head -c 16 /dev/urandom | base64 | tr "+/" "-_" | cut -c 1-22)
    case $id in -*) ;; *) printf '%s' "$id"; return ;; esac
  done
}

if [ "${1:-}" = "--dump-cds" ]; then
  # Build time: start a throwaway broker once and dump the classes it loaded at exit (class-data
  # sharing), so every container's broker starts about twice as fast. Random loopback ports: a
  # build may share the host's network.
  p=$(($(od -An -N2 -tu2 /dev/urandom) % 20000 + 30000))
  d=$(mktemp -d)
  cat >"$d/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$((p + 1))
listeners=PLAINTEXT://127.0.0.1:$p,CONTROLLER://127.0.0.1:$((p + 1))
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
controller.listener.names=CONTROLLER
offsets.topic.replication.factor=1
log.dirs=$d/data
PROPS
  java -Xmx256m -cp "$cp" kafka.tools.StorageTool format --cluster-id="$(new_cluster_id)" -c "$d/server.properties" >/dev/null
  # shellcheck disable=SC2086
  java -Xmx512m $jvm -XX:ArchiveClassesAtExit="$jsa" -cp "$cp" kafka.Kafka "$d/server.properties" >"$d/log" 2>&1 &
  pid=$!
  i=0
  until grep -q "Kafka Server started" "$d/log"; do
    i=$((i + 1))
    if [ "$i" -gt 600 ] || ! kill -0 "$pid" 2>/dev/null; then
      tail -n 30 "$d/log" >&2
      rm -rf "$d"
      echo "no class-data archive: the broker did not start" >&2
      exit 0
    fi
    sleep 0.2
  done
  kill -TERM "$pid"
  wait "$pid" || true
  rm -rf "$d"
  ls -l "$jsa" >&2 || true
  exit 0
fi

conf=/opt/kafka/server.properties
: >"$conf"
env | grep '^KAFKA_' | while IFS= read -r line; do
  name=${line%%=*}
  case $name in
    KAFKA_HEAP_OPTS | KAFKA_OPTS | KAFKA_JVM_OPTS | KAFKA_VERSION) continue ;;
  esac
  key=$(printf '%s' "${name#KAFKA_}" | sed -e 's/___/-/g' -e 's/__/@/g' -e 's/_/./g' -e 's/@/_/g' | tr '[:upper:]' '[:lower:]')
  printf '%s=%s\n' "$key" "${line#*=}" >>"$conf"
done
if [ ! -s "$conf" ]; then
  cat >"$conf" <<'PROPS'
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@localhost:9093
listeners=PLAINTEXT://:9092,CONTROLLER://:9093
advertised.listeners=PLAINTEXT://localhost:9092
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
log.dirs=/var/lib/kafka/data
PROPS
fi
grep -q '^log.dirs=' "$conf" || echo "log.dirs=/var/lib/kafka/data" >>"$conf"
logdir=$(sed -n 's/^log\.dirs=//p' "$conf" | cut -d, -f1)
mkdir -p "$logdir"
if [ ! -f "$logdir/meta.properties" ]; then
  # A restarted container keeps its data and cluster id: format only an empty log dir.
  cluster_id=${CLUSTER_ID:-$(new_cluster_id)}
  java -Xmx256m -XX:TieredStopAtLevel=1 -cp "$cp" kafka.tools.StorageTool format --cluster-id="$cluster_id" -c "$conf"
fi
# Sized like LocalKafka: a small CI machine shares its cores with the tests.
cds=""
[ -s "$jsa" ] && cds="-XX:SharedArchiveFile=$jsa -Xlog:cds=off -Xlog:cds+dynamic=off"
# shellcheck disable=SC2086
exec java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx768m} $jvm $cds ${KAFKA_OPTS:-} -cp "$cp" kafka.Kafka "$conf"
