"""A real single-node KRaft Kafka run straight from Maven Central jars: no Docker engine on our dev
and CI machines, and a mock broker would hide exactly the group/offset semantics kvwire relies on."""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import daemon
from . import probe

log = logging.getLogger("kvwire.kafka.broker")

POM = Path(__file__).with_name("pom.xml")
DEFAULT_PORT = 19092
# However long a broker keeps logging, a start gives up after this: recovering ~1,400 partitions
# took 106 s here, and one that cannot join (logging its retries) must still fail in bounded time.
START_CAP_S = 300.0
# Sized for 2 cores: default heap and GC thread counts starve the Python side of tests.
JVM_OPTS = ["-Xms256m", "-Xmx768m", "-XX:+UseG1GC", "-XX:ParallelGCThreads=2", "-XX:ConcGCThreads=1"]


class BrokerError(RuntimeError):
    pass


def default_home() -> Path:
    return Path(os.environ.get("KVWIRE_KAFKA_HOME") or Path.home() / ".cache" / "kvwire" / "kafka")


def default_port() -> int:
    return int(os.environ.get("KVWIRE_KAFKA_PORT") or DEFAULT_PORT)


def new_cluster_id() -> str:
    """Kafka's Uuid form. About 1 draw in 64 starts with "-", which Kafka's own random-uuid never
    returns: StorageTool would read it as an option. Draw again then, as Kafka does (the format
    call passes --cluster-id=ID too, so an id given by a caller is never misread)."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode()[:22]
        if not cid.startswith("-"):
            return cid


@dataclass(frozen=True)
class Status:
    running: bool
    bootstrap: str
    pid: int | None


class LocalKafka:
    """One broker per home directory. Data survives stop/kill/restart; only `wipe()` deletes it."""

    def __init__(
        self,
        home: str | os.PathLike | None = None,
        port: int | None = None,
        *,
        extra_properties: Mapping[str, Any] | None = None,
        format_args: list[str] | None = None,
        client_config: Mapping[str, Any] | None = None,
        libs_dir: str | os.PathLike | None = None,
        start_timeout_s: float = 60.0,
        cluster_id: str | None = None,
        jvm_opts: list[str] | None = None,
    ) -> None:
        self.jvm_opts = list(jvm_opts) if jvm_opts is not None else list(JVM_OPTS)
        self.home = Path(home) if home else default_home()
        # The members of one multi-broker cluster (kvwire.kafka.broker.cluster) format with one id.
        self.cluster_id = cluster_id
        self.port = port or default_port()
        self.controller_port = self.port + 1
        # Hooks for e.g. a SASL/SCRAM broker: override listeners/protocol map here, add
        # `--add-scram ...` to the format step, and give the readiness probe matching credentials.
        self.extra_properties = dict(extra_properties or {})
        self.format_args = list(format_args or [])
        self.client_config = dict(client_config or {})
        # Shared across homes: the jars are immutable and re-resolving costs ~10-30 s.
        self.libs = Path(libs_dir) if libs_dir else default_home() / "libs"
        self.start_timeout_s = start_timeout_s

    # -- paths -------------------------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    data_dir = property(lambda self: self.home / "data")
    config_path = property(lambda self: self.home / "server.properties")
    log_path = property(lambda self: self.home / "kafka.log")
    pid_path = property(lambda self: self.home / "kafka.pid")

    # -- public API --------------------------------------------------------------------------
    def start(self, wait: bool = True, *, fresh: bool = False) -> str:
        """Idempotent: returns the bootstrap of the already running broker or of a new one.
        ``wait=False`` returns once the JVM is launched: a cluster member cannot answer until a
        quorum of its peers is up, so the cluster launches all of them before waiting.
        ``fresh=True`` empties the log first when this call launches the JVM (a running broker
        is someone's, and is left as it is): a CI run must not inherit every topic an earlier
        run made, nor wait out their recovery after a crash."""
        self.home.mkdir(parents=True, exist_ok=True)
        with daemon.file_lock(self.home / ".lock"):  # concurrent starters (CLI + pytest): one JVM
            pid = self.pid()
            if pid is not None:
                if fresh:
                    log.info("the broker of %s already runs (pid %s): used as it is, its log kept", self.home, pid)
                if wait:
                    self._wait_ready(pid)
                return self.bootstrap
            if probe.port_open("127.0.0.1", self.port) or probe.port_open("127.0.0.1", self.controller_port):
                raise BrokerError(
                    f"port {self.port} or {self.controller_port} is taken by a process that is not "
                    f"the broker of {self.home}; set KVWIRE_KAFKA_PORT or KAFKA_BOOTSTRAP_SERVERS"
                )
            if fresh:
                shutil.rmtree(self.data_dir, ignore_errors=True)
            self.ensure_libs()
            self._write_config()
            self._format()
            pid = self._spawn()
            if wait:
                self._wait_ready(pid)
            return self.bootstrap

    def wait_ready(self) -> None:
        pid = self.pid()
        if pid is None:
            raise BrokerError(f"broker of {self.home} is not running; log tail:\n{self.log_tail()}")
        self._wait_ready(pid)

    def status(self) -> Status:
        pid = self.pid()
        ok = pid is not None and probe.answers(self.bootstrap, 5.0, **self.client_config)
        return Status(ok, self.bootstrap, pid)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Graceful (SIGTERM: controlled shutdown, clean log), SIGKILL if it hangs."""
        pid = self.pid()
        if pid is not None and not daemon.stop(pid, timeout_s):
            log.warning("broker pid %s ignored SIGTERM for %.0fs; killed", pid, timeout_s)
        self.pid_path.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL, no controlled shutdown: for fault tests; the data dir is kept for restart()."""
        pid = self.pid()
        if pid is not None:
            daemon.send(pid, signal.SIGKILL)
            daemon.wait_dead(pid, 10)
        self.pid_path.unlink(missing_ok=True)

    def restart(self, *, hard: bool = False) -> str:
        """Same data dir, same cluster id: committed log and offsets survive."""
        self.kill() if hard else self.stop()
        return self.start()

    def wipe(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def pid(self) -> int | None:
        """The pid of *this home's* broker if alive (guards against pid reuse by other processes)."""
        return daemon.owned_pid(self.pid_path, str(self.config_path))

    def ensure_libs(self) -> Path:
        """Resolve the broker jars with Maven once; a marker keyed on the pom redoes partial copies."""
        stamp = hashlib.sha256(POM.read_bytes()).hexdigest()[:16]
        marker = self.libs / ".resolved"
        if marker.exists() and marker.read_text() == stamp:
            return self.libs
        mvn = shutil.which("mvn")
        if not mvn or not shutil.which("java"):
            raise BrokerError("a local Kafka needs `java` (>=17) and `mvn` on PATH")
        log.info("resolving Kafka jars with Maven into %s (first run only)", self.libs)
        shutil.rmtree(self.libs, ignore_errors=True)
        self.libs.mkdir(parents=True)
        t0 = time.monotonic()
        r = subprocess.run(
            [
                mvn,
                "-q",
                "-B",
                "-f",
                str(POM),
                "dependency:copy-dependencies",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={self.libs}",
            ],
            capture_output=True,
            text=True,
            cwd=self.libs,
        )
        if r.returncode != 0:
            raise BrokerError(f"maven failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
        marker.write_text(stamp)
        log.info("resolved %d jars in %.1fs", len(list(self.libs.glob("*.jar"))), time.monotonic() - t0)
        return self.libs

    # -- internals ---------------------------------------------------------------------------
    def properties(self) -> dict[str, str]:
        p, c = self.port, self.controller_port
        props: dict[str, Any] = {
            "process.roles": "broker,controller",
            "node.id": 1,
            "controller.quorum.voters": f"1@127.0.0.1:{c}",
            "listeners": f"PLAINTEXT://127.0.0.1:{p},CONTROLLER://127.0.0.1:{c}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{p}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": self.data_dir,
            "num.partitions": 1,
            "auto.create.topics.enable": "true",
            # Single node: every internal topic must fit on one replica or groups/txns never work.
            "offsets.topic.replication.factor": 1,
            "transaction.state.log.replication.factor": 1,
            "transaction.state.log.min.isr": 1,
            "share.coordinator.state.topic.replication.factor": 1,
            "share.coordinator.state.topic.min.isr": 1,
            "min.insync.replicas": 1,
            # 50 partitions per internal topic is the default: slow to create on 2 cores.
            "offsets.topic.num.partitions": 1,
            "transaction.state.log.num.partitions": 1,
            # Tests join groups constantly; the 3 s default delay is pure waiting.
            "group.initial.rebalance.delay.ms": 0,
            # After a SIGKILL the restarted broker cannot register until the dead incarnation's
            # session expires (9 s by default): shorter, for fault tests, yet far above GC pauses.
            "broker.heartbeat.interval.ms": 500,
            "broker.session.timeout.ms": 4000,
            "num.network.threads": 2,
            "num.io.threads": 2,
            "num.recovery.threads.per.data.dir": 1,
            "background.threads": 2,
            "log.cleaner.threads": 1,
            "log.cleaner.dedupe.buffer.size": 16777216,  # 128 MiB of heap by default
        }
        for k, v in self.extra_properties.items():
            if v is None:
                props.pop(k, None)
            else:
                props[k] = v
        return {k: str(v) for k, v in props.items()}

    def _write_config(self) -> None:
        text = "".join(f"{k}={v}\n" for k, v in self.properties().items())
        self.config_path.write_text("# written by kvwire.kafka.broker.LocalKafka; edits are overwritten\n" + text)

    def _java(self, *args: str, opts: Sequence[str] = ()) -> list[str]:
        return ["java", *opts, "-cp", f"{self.libs}/*", *args]

    def _format(self) -> None:
        if (self.data_dir / "meta.properties").exists():
            return  # already formatted: keep the cluster id and the log
        cmd = self._java(
            "kafka.tools.StorageTool",
            "format",
            f"--cluster-id={self.cluster_id or new_cluster_id()}",
            "-c",
            str(self.config_path),
            *self.format_args,
            opts=["-Xmx256m", "-XX:TieredStopAtLevel=1"],
        )
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise BrokerError(f"kafka storage format failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")

    def _cds_opts(self) -> list[str]:
        """Class-data sharing: the first run dumps loaded classes at exit, later runs map them
        (start ~2x faster). The archive name is keyed on the jar set so an upgrade never mismatches."""
        if os.environ.get("KVWIRE_KAFKA_CDS", "1") == "0":
            return []
        names = "\n".join(sorted(p.name for p in self.libs.glob("*.jar")))
        archive = self.libs / f"kafka-{hashlib.sha256(names.encode()).hexdigest()[:12]}.jsa"
        if archive.exists() and archive.stat().st_size > 0:
            return [f"-XX:SharedArchiveFile={archive}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
        return [f"-XX:ArchiveClassesAtExit={archive}"]

    def _spawn(self) -> int:
        cmd = self._java("kafka.Kafka", str(self.config_path), opts=self.jvm_opts + self._cds_opts())
        pid = daemon.spawn(cmd, self.log_path, self.pid_path)
        log.info("started Kafka pid %s on %s (log %s)", pid, self.bootstrap, self.log_path)
        return pid

    def _wait_ready(self, pid: int) -> None:
        # The broker logs a line per partition it recovers: a growing log is a broker at work.
        why = daemon.wait_ready(
            pid,
            lambda: probe.answers(self.bootstrap, 5.0, **self.client_config),
            self.start_timeout_s,
            progress=self._log_size,
            cap_s=START_CAP_S,
        )
        if why is not None:
            raise BrokerError(f"Kafka {why}; log tail:\n{self.log_tail()}")

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return -1

    def log_tail(self, n: int = 40) -> str:
        return daemon.log_tail(self.log_path, n)
