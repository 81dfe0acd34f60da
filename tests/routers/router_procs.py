"""The processes the router tests start: ``kvwire index --event-streams`` and the clients."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from polling import free_port, wait_for
from processes import Process
from processes import http_json as _http_json
from streams_fleet import free_base


class IndexProcess:
    """``kvwire index --event-streams`` as an operator runs it."""

    def __init__(self, bootstrap: str, topic: str, heartbeat_timeout_s: float = 60.0) -> None:
        self.http = f"http://127.0.0.1:{free_port()}"
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="kvwire-index-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, "-m", "kvwire.cli", "index", "-b", bootstrap, "-t", topic]
        cmd += ["--http", self.http.removeprefix("http://"), "--event-streams", f"127.0.0.1:{free_base()}"]
        cmd += ["--heartbeat-timeout", str(heartbeat_timeout_s)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self._ready, "kvwire index caught up", timeout=120)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"kvwire index exited: {self.tail()}")
        try:
            return self.get("/healthz")["ready"] is True
        except OSError:
            return False

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.http + path, timeout=10) as r:
            return json.loads(r.read())

    def streams(self) -> list[dict[str, Any]]:
        return self.get("/v1/streams")["streams"]

    def ranks(self) -> dict[tuple[str, int, int], dict[str, Any]]:
        return {
            (w["instance_id"], w["dp_rank"], r["tp_rank"]): r
            for w in self.get("/v1/workers")["workers"]
            for r in w["ranks"]
        }

    def tail(self) -> str:
        self.log.flush()
        with open(self.log.name, "rb") as f:
            return f.read()[-3000:].decode(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


class Proc(Process):
    """A client process with its output kept for the failure message."""

    def __init__(self, cmd: list[str], name: str) -> None:
        fd, log = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        os.close(fd)
        super().__init__(cmd, Path(log))
        self.name = name

    def tail(self, lines: int = 60) -> str:
        return super().tail(lines)


def http_json(url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, Any]:
    """GET without a body, POST with one (``processes.http_json``)."""
    return _http_json("GET" if body is None else "POST", url, body, timeout)


def wait_http(url: str, proc: Proc, timeout: float = 120.0) -> None:
    def up() -> bool:
        if not proc.alive():
            raise AssertionError(f"{proc.name} exited: {proc.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            time.sleep(0.1)
            return False

    wait_for(up, f"{proc.name} listening", timeout=timeout)
