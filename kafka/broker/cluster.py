"""A multi-broker KRaft cluster on one machine, from the same Maven jars as LocalKafka.

Every node is a combined broker+controller (a LocalKafka with its own home and ports), and the
controllers form a static quorum, so the cluster survives the loss of any one node of three:
the shape the fault suite needs (leader loss, rolling restarts) and what production runs.

Ports: node i (0-based) listens on ``port + 2*i`` and its controller on the next port, so the
default three-node cluster on 19192 uses 19192..19197. Homes: ``<home>/node-<i>``; the cluster
id is kept in ``<home>/cluster.id`` so a restarted node rejoins its own cluster.

Internal topics get replication factor min(3, brokers) and ``min.insync.replicas`` 2 (from
three brokers on), and so does every topic created without its own settings.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import daemon
from . import probe
from .local import JVM_OPTS, BrokerError, LocalKafka, default_home, new_cluster_id

log = logging.getLogger("kvwire.kafka.broker")

DEFAULT_CLUSTER_PORT = 19192
# Three JVMs share the machine: a smaller heap each than a lone broker gets.
CLUSTER_JVM_HEAP = "-Xmx512m"


def default_cluster_home(brokers: int) -> Path:
    return default_home() / f"cluster-{brokers}"


@dataclass(frozen=True)
class ClusterStatus:
    bootstrap: str
    running: list[bool]  # per node

    @property
    def all_running(self) -> bool:
        return all(self.running)


class LocalCluster:
    def __init__(
        self,
        home: str | os.PathLike | None = None,
        port: int | None = None,
        brokers: int = 3,
        *,
        extra_properties: Mapping[str, Any] | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        if brokers < 1:
            raise ValueError("brokers must be >= 1")
        self.home = Path(home) if home else default_cluster_home(brokers)
        self.base_port = port or DEFAULT_CLUSTER_PORT
        self.size = brokers
        self.start_timeout_s = start_timeout_s
        self.home.mkdir(parents=True, exist_ok=True)
        id_file = self.home / "cluster.id"
        if not id_file.exists():
            id_file.write_text(new_cluster_id() + "\n")
        self.cluster_id = id_file.read_text().strip()
        voters = ",".join(f"{i + 1}@127.0.0.1:{self.base_port + 2 * i + 1}" for i in range(brokers))
        rf = min(3, brokers)
        isr = 2 if rf >= 3 else 1
        self.nodes: list[LocalKafka] = []
        for i in range(brokers):
            props: dict[str, Any] = {
                "node.id": i + 1,
                "controller.quorum.voters": voters,
                "offsets.topic.replication.factor": rf,
                "transaction.state.log.replication.factor": rf,
                "transaction.state.log.min.isr": isr,
                "share.coordinator.state.topic.replication.factor": rf,
                "share.coordinator.state.topic.min.isr": isr,
                "default.replication.factor": rf,
                "min.insync.replicas": isr,
                # A restarted node takes its partitions' leadership back soon, as in production.
                "leader.imbalance.check.interval.seconds": 10,
                **(extra_properties or {}),
            }
            node = LocalKafka(
                self.home / f"node-{i}",
                self.base_port + 2 * i,
                extra_properties=props,
                start_timeout_s=start_timeout_s,
                cluster_id=self.cluster_id,
                jvm_opts=[o for o in JVM_OPTS if not o.startswith("-Xmx")] + [CLUSTER_JVM_HEAP],
            )
            self.nodes.append(node)

    @property
    def bootstrap(self) -> str:
        return ",".join(n.bootstrap for n in self.nodes)

    def start(self, *, fresh: bool = False) -> str:
        """Idempotent: launches every node that is not running, then waits until the cluster
        reports all of them registered. ``fresh`` empties the logs only when no node runs: one
        voter wiped under live peers would lose the quorum's metadata."""
        fresh = fresh and all(n.pid() is None for n in self.nodes)
        for n in self.nodes:
            n.start(wait=False, fresh=fresh)
        self.wait_brokers(self.size, require=range(1, self.size + 1))
        return self.bootstrap

    def start_node(self, i: int) -> None:
        """Restart one node (same data dir) and wait until it serves again and the cluster lists
        it. Counting brokers alone is not enough: right after a SIGKILL the controller still
        lists the dead incarnation until its session times out, so the count is already met
        while the new JVM is seconds from answering (a topic created then got two replicas)."""
        node = self.nodes[i]
        node.start(wait=False)
        node.wait_ready()  # its own listener serves: registered and unfenced
        self.wait_brokers(self.live_nodes(), require={i + 1})

    def kill_node(self, i: int) -> None:
        """SIGKILL: no controlled shutdown, leadership moves only once the controller fences it."""
        self.nodes[i].kill()

    def stop_node(self, i: int) -> None:
        """SIGTERM: controlled shutdown, leadership moves first."""
        self.nodes[i].stop()

    def live_nodes(self) -> int:
        return sum(1 for n in self.nodes if n.pid() is not None)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Graceful, all nodes at once: one by one, the last ones would wait for a controller
        quorum that has already gone and hang until killed."""
        pids = [(n, n.pid()) for n in self.nodes]
        for _n, pid in pids:
            if pid is not None:
                daemon.send(pid, signal.SIGTERM)
        for n, pid in pids:
            if pid is not None and not daemon.wait_dead(pid, timeout_s):
                log.warning("broker pid %s ignored SIGTERM for %.0fs; killing", pid, timeout_s)
            n.kill()  # no-op for a node that is gone; also drops its pid file

    def kill(self) -> None:
        for n in self.nodes:
            n.kill()

    def status(self) -> ClusterStatus:
        return ClusterStatus(self.bootstrap, [n.pid() is not None and probe.answers(n.bootstrap) for n in self.nodes])

    def wait_brokers(self, count: int, timeout_s: float | None = None, *, require: Collection[int] = ()) -> None:
        """Until some node's metadata lists ``count`` registered brokers, ``require``'s ids among them."""
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        # Probing nodes that are still starting makes aiokafka log a connection error per try.
        quiet = logging.getLogger("aiokafka")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)
        try:
            self._wait_brokers(count, deadline, require)
        finally:
            quiet.setLevel(level)

    def _wait_brokers(self, count: int, deadline: float, require: Collection[int]) -> None:
        last: Any = None
        while time.monotonic() < deadline:
            for n in self.nodes:
                if n.pid() is None:
                    continue
                try:
                    desc = probe.run_sync(functools.partial(probe.describe_cluster, n.bootstrap, 5.0))
                except Exception as e:
                    last = e
                    continue
                ids = {b["node_id"] for b in desc.get("brokers") or ()}
                if len(ids) >= count and ids.issuperset(require):
                    return
                last = f"brokers {sorted(ids)} registered"
            time.sleep(0.5)
        tails = "\n".join(f"--- node {i}:\n{n.log_tail(15)}" for i, n in enumerate(self.nodes))
        raise BrokerError(f"cluster not at {count} brokers after the timeout ({last!r}); log tails:\n{tails}")

    def node_of(self, broker_id: int) -> int:
        """Index in ``nodes`` of a broker id (node.id = index + 1)."""
        return broker_id - 1
