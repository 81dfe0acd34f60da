"""Commands run as their users run them: a child process with its output in a log file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Process:
    """``argv`` as a child, stdout and stderr to ``log``; ``stop`` sends SIGTERM, then kills."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.argv, self.log = argv, log
        self._out = open(log, "ab")  # noqa: SIM115 - the child writes to it until stop()
        base = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_KAFKA_")}
        self.proc = subprocess.Popen(
            argv, stdout=self._out, stderr=subprocess.STDOUT, env={**base, **(env or {})}, cwd=ROOT
        )

    @classmethod
    def kvwire(cls, args: list[str], log: Path, env: dict[str, str] | None = None) -> Process:
        return cls([sys.executable, "-c", "from kvwire.cli import app; app()", *args], log, env)

    @classmethod
    def python_module(cls, module: str, args: list[str], log: Path) -> Process:
        return cls([sys.executable, "-m", module, *args], log)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def http_json(method: str, url: str, body: object = None, timeout: float = 10.0) -> tuple[int, object]:
    """(status, decoded JSON body or text) of one request; never raises for an HTTP status."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")
