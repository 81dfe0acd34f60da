"""Detached local services (the Kafka broker, the schema registry): one process per home
directory, orphaned at start so it outlives the CLI or test session that started it, found
again through a pid file, stopped by signal."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path


def alive(pid: int) -> bool:
    # A JVM's main thread turns zombie before its other threads have exited and released the
    # listening sockets, and our PID 1 may never reap it: alive = any thread not yet dead.
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        if stat.rpartition(")")[2].split()[0] not in ("Z", "X"):
            return True
    return False


def owned_pid(pid_path: Path, marker: str) -> int | None:
    """The pid in ``pid_path`` if that process is alive and its command line holds ``marker``
    (a pid file can outlive its process, and the pid be reused by another)."""
    try:
        pid = int(pid_path.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if marker.encode() not in cmdline or not alive(pid):
        return None
    return pid


def spawn(cmd: list[str], log_path: Path, pid_path: Path, cwd: Path | None = None) -> int:
    """Start ``cmd`` detached, output appended to ``log_path``; writes and returns its pid."""
    quoted = " ".join(shlex.quote(a) for a in cmd)
    cd = f"cd {shlex.quote(str(cwd))} && " if cwd is not None else ""
    # `sh -c '... &'` orphans the process at once: no zombie or ResourceWarning in the caller,
    # and its own session keeps it alive after the CLI or pytest exits.
    r = subprocess.run(
        ["sh", "-c", f"{cd}{quoted} >>{shlex.quote(str(log_path))} 2>&1 </dev/null & echo $!"],
        capture_output=True,
        text=True,
        start_new_session=True,
        check=True,
    )
    pid = int(r.stdout.strip())
    pid_path.write_text(f"{pid}\n")
    return pid


def wait_ready(
    pid: int,
    ready: Callable[[], bool],
    timeout_s: float,
    progress: Callable[[], object] | None = None,
    cap_s: float | None = None,
) -> str | None:
    """None once ``ready()``; else why not (the process died, or the time ran out).

    With ``progress`` (a value that changes while startup advances, such as the size of the
    process's log), ``timeout_s`` counts from its last change, up to ``cap_s`` in all: a broker
    that recovers a thousand logs after a crash is slow, not stuck, and one that stops writing
    is stuck however young it is."""
    t0 = time.monotonic()
    cap = t0 + max(timeout_s, cap_s or 0.0)
    deadline = t0 + timeout_s
    seen = progress() if progress else None
    while (now := time.monotonic()) < min(deadline, cap):
        if not alive(pid):
            return "exited during startup"
        if ready():
            return None
        if progress is not None and (p := progress()) != seen:
            seen, deadline = p, now + timeout_s
        time.sleep(0.25)
    if progress is not None and time.monotonic() < cap:
        return f"not ready, and no progress for {timeout_s:.0f}s"
    return f"not ready after {time.monotonic() - t0:.0f}s"


def send(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def wait_dead(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap if it happens to be our child
        if not alive(pid):
            return True
        time.sleep(0.1)
    return not alive(pid)


def stop(pid: int, timeout_s: float) -> bool:
    """SIGTERM (a clean shutdown), SIGKILL if it is still alive after ``timeout_s``.
    Returns False when it took the SIGKILL."""
    send(pid, signal.SIGTERM)
    if wait_dead(pid, timeout_s):
        return True
    send(pid, signal.SIGKILL)
    wait_dead(pid, 10)
    return False


def log_tail(log_path: Path, n: int = 40) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive across processes: a CLI and a test session must not start two services."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
