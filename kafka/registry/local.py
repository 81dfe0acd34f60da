"""A real schema registry, Apicurio Registry 3.0.9, run from the one Maven Central artifact
``io.apicurio:apicurio-registry-app:3.0.9:tar.gz:all`` on the installed Java 17 (3.3.x needs Java
21, which Debian 12 does not package). Managed like the local Kafka (kvwire.kafka.broker.local):
idempotent start under a file lock, status, stop; the distribution is resolved once and cached
under ~/.cache/kvwire. kvwire talks to it through its Confluent-compatible API, the URL that
start() returns, exactly as it would to Confluent's registry.

Storage is an H2 file in the home directory, not Apicurio's in-memory default: records on Kafka
name registry ids, so a restarted registry must still know them."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvwire.kafka.broker.probe import port_open

from .. import daemon

log = logging.getLogger("kvwire.kafka.registry")

APICURIO_VERSION = "3.0.9"
ARTIFACT = f"io.apicurio:apicurio-registry-app:{APICURIO_VERSION}:tar.gz:all"
# Pinned: 3.x reads the artifact's descriptor, whose parent pom (io.apicurio:apicurio-registry:3.0.9)
# Maven Central does not serve; 2.8 copies the file alone.
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:2.8"
DEFAULT_PORT = 18081
CCOMPAT_PATH = "/apis/ccompat/v7"
# Sized for 2 shared cores: C1 only starts Quarkus ~2x faster and a registry's traffic is tiny.
JVM_OPTS = [
    "-Xms64m",
    "-Xmx384m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:CICompilerCount=2",
]


class RegistryStartError(RuntimeError):
    pass


def cache_root() -> Path:
    return Path.home() / ".cache" / "kvwire"


def default_home() -> Path:
    return Path(os.environ.get("KVWIRE_REGISTRY_HOME") or cache_root() / "registry")


def default_port() -> int:
    return int(os.environ.get("KVWIRE_REGISTRY_PORT") or DEFAULT_PORT)


def default_dist() -> Path:
    return Path(os.environ.get("KVWIRE_REGISTRY_DIST") or cache_root() / f"apicurio-registry-{APICURIO_VERSION}")


@dataclass(frozen=True)
class Status:
    running: bool
    url: str
    pid: int | None


def answers(url: str, timeout_s: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/subjects", timeout=timeout_s) as r:
            return r.status == 200 and isinstance(json.loads(r.read() or b"null"), list)
    except (OSError, ValueError):
        return False


class LocalRegistry:
    """One registry per home directory. Its schemas survive stop/kill/restart; `wipe()` deletes them."""

    def __init__(
        self,
        home: str | os.PathLike[str] | None = None,
        port: int | None = None,
        *,
        dist_dir: str | os.PathLike[str] | None = None,
        start_timeout_s: float = 180.0,
    ) -> None:
        self.home = Path(home) if home else default_home()
        self.port = port or default_port()
        # Shared across homes: ~220 MB unpacked and immutable.
        self.dist = Path(dist_dir) if dist_dir else default_dist()
        self.start_timeout_s = start_timeout_s

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{CCOMPAT_PATH}"

    data_dir = property(lambda self: self.home / "data")
    log_path = property(lambda self: self.home / "registry.log")
    pid_path = property(lambda self: self.home / "registry.pid")
    runner = property(lambda self: self.dist / f"apicurio-registry-app-{APICURIO_VERSION}-runner.jar")

    # -- public API --------------------------------------------------------------------------
    def start(self) -> str:
        """Idempotent: the URL of the already running registry or of a new one."""
        self.home.mkdir(parents=True, exist_ok=True)
        with daemon.file_lock(self.home / ".lock"):  # a CLI and a test session must not start two JVMs
            pid = self.pid()
            if pid is not None:
                self._wait_ready(pid)
                return self.url
            if port_open("127.0.0.1", self.port):
                raise RegistryStartError(
                    f"port {self.port} is taken by a process that is not the registry of {self.home}; "
                    "set KVWIRE_REGISTRY_PORT, or KVWIRE_SCHEMA_REGISTRY_URL to use a running registry"
                )
            self.ensure_dist()
            pid = self._spawn()
            self._wait_ready(pid)
            return self.url

    def status(self) -> Status:
        pid = self.pid()
        return Status(pid is not None and answers(self.url), self.url, pid)

    def stop(self, timeout_s: float = 30.0) -> None:
        pid = self.pid()
        if pid is not None and not daemon.stop(pid, timeout_s):
            log.warning("registry pid %s ignored SIGTERM for %.0fs; killed", pid, timeout_s)
        self.pid_path.unlink(missing_ok=True)

    def wipe(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def pid(self) -> int | None:
        """The pid of *this home's* registry if alive (guards against pid reuse)."""
        return daemon.owned_pid(self.pid_path, self._marker())

    def ensure_dist(self) -> Path:
        """Resolve the distribution with Maven once (Maven caches the tarball in ~/.m2 too)."""
        marker = self.dist / ".resolved"
        if marker.exists() and marker.read_text() == ARTIFACT and self.runner.exists():
            return self.dist
        mvn = shutil.which("mvn")
        if not mvn or not shutil.which("java"):
            raise RegistryStartError("a local schema registry needs `java` (>=17) and `mvn` on PATH")
        self.dist.parent.mkdir(parents=True, exist_ok=True)
        with daemon.file_lock(self.dist.parent / f".{self.dist.name}.lock"):
            if marker.exists() and marker.read_text() == ARTIFACT and self.runner.exists():
                return self.dist
            log.info("resolving %s with Maven into %s (first run only)", ARTIFACT, self.dist)
            t0 = time.monotonic()
            with tempfile.TemporaryDirectory(dir=self.dist.parent, prefix=".apicurio-") as tmp:
                r = subprocess.run(
                    [
                        mvn,
                        "-q",
                        "-B",
                        f"{DEPENDENCY_PLUGIN}:copy",
                        f"-Dartifact={ARTIFACT}",
                        f"-DoutputDirectory={tmp}",
                    ],
                    capture_output=True,
                    text=True,
                    cwd=tmp,
                )
                if r.returncode != 0:
                    raise RegistryStartError(f"maven failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
                (tarball,) = Path(tmp).glob("*.tar.gz")
                unpacked = Path(tmp) / "dist"
                with tarfile.open(tarball) as tf:
                    tf.extractall(unpacked, filter="data")
                tarball.unlink()
                shutil.rmtree(self.dist, ignore_errors=True)
                unpacked.rename(self.dist)
            marker.write_text(ARTIFACT)
            log.info("resolved the registry in %.1fs", time.monotonic() - t0)
        return self.dist

    def log_tail(self, n: int = 40) -> str:
        return daemon.log_tail(self.log_path, n)

    # -- internals ---------------------------------------------------------------------------
    def _marker(self) -> str:
        return f"-Dkvwire.registry.home={self.home}"

    def command(self) -> list[str]:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return [
            "java",
            *JVM_OPTS,
            self._marker(),
            f"-Dquarkus.http.port={self.port}",
            "-Dquarkus.http.host=127.0.0.1",
            f"-Dapicurio.datasource.url=jdbc:h2:file:{self.data_dir / 'registry'}",
            "-jar",
            str(self.runner),
        ]

    def _spawn(self) -> int:
        # Orphaned at once (as the broker is): it outlives the CLI or the test session.
        pid = daemon.spawn(self.command(), self.log_path, self.pid_path, cwd=self.home)
        log.info("started Apicurio Registry pid %s on %s (log %s)", pid, self.url, self.log_path)
        return pid

    def _wait_ready(self, pid: int) -> None:
        why = daemon.wait_ready(pid, lambda: answers(self.url), self.start_timeout_s)
        if why is not None:
            raise RegistryStartError(f"the registry {why}; log tail:\n{self.log_tail()}")


def resolve_url() -> str:
    """KVWIRE_SCHEMA_REGISTRY_URL when set (never touched), else a started local registry."""
    from .client import ENV_URL

    return os.environ.get(ENV_URL) or LocalRegistry().start()
