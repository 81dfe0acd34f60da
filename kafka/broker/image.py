"""Container images of our own, built locally with whatever engine answers (podman or docker).

No registry is needed: the base is Debian bookworm made by debootstrap from Debian's archive and
imported as `localhost/kvwire-base:bookworm` (rootfs tarball cached, so a warm machine re-imports in
seconds, and an image already in the engine's store is reused as is). A user whose engine reaches a
registry can pass any Debian bookworm image as the base instead (`--base debian:bookworm-slim`).

Every image is tagged under `localhost/kvwire-*`: never under another project's name."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .local import POM, BrokerError, LocalKafka

log = logging.getLogger("kvwire.kafka.broker")

KAFKA_CONTEXT = Path(__file__).with_name("kafka-image")
BASE_REF = "localhost/kvwire-base:bookworm"
KAFKA_REPO = "localhost/kvwire-kafka"
APP_REF = "localhost/kvwire:dev"
CONTEXT_LABEL = "dev.kvwire.context"
DEBIAN_MIRROR = os.environ.get("KVWIRE_DEBIAN_MIRROR", "http://deb.debian.org/debian")


class ImageError(BrokerError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("KVWIRE_IMAGE_CACHE") or Path.home() / ".cache" / "kvwire" / "images")


def kafka_version() -> str:
    m = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", POM.read_text())
    if not m:
        raise ImageError(f"no kafka.version in {POM}")
    return m.group(1).strip()


def kafka_ref() -> str:
    return f"{KAFKA_REPO}:{kafka_version()}"


def _run(
    cmd: Sequence[str], *, timeout: float | None = None, quiet: bool = False, stream: bool = False
) -> subprocess.CompletedProcess:
    """stream: the tool's output goes to our stderr as it comes (minutes-long builds show progress;
    stdout stays for the image reference alone)."""
    if not quiet:
        log.info("+ %s", " ".join(cmd))
    if stream:
        r = subprocess.run(list(cmd), stdout=sys.stderr, stderr=sys.stderr, text=True, timeout=timeout)
        if r.returncode != 0:
            raise ImageError(f"{cmd[0]} {cmd[1]} failed ({r.returncode}); its output is above")
        return r
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 and not quiet:
        raise ImageError(f"{cmd[0]} {cmd[1]} failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return r


def find_engine(preferred: str | None = None) -> str:
    """The first engine CLI whose engine answers. podman first: it needs no daemon, and a `docker`
    client without an engine (as on our CI machines) would only fail later."""
    names = [preferred] if preferred else [os.environ.get("KVWIRE_ENGINE") or "", "podman", "docker"]
    tried = []
    for name in filter(None, names):
        exe = shutil.which(name)
        if not exe:
            tried.append(f"{name}: not installed")
            continue
        try:
            r = subprocess.run([exe, "info"], capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            tried.append(f"{name}: `info` timed out")
            continue
        if r.returncode == 0:
            return exe
        tried.append(f"{name}: {(r.stderr or r.stdout).strip().splitlines()[-1:] or ['no answer']}")
    raise ImageError("no container engine answers (" + "; ".join(tried) + ")")


def image_label(engine: str, ref: str, label: str) -> str | None:
    """The label's value, "" when the image has none, None when there is no such image."""
    r = _run([engine, "image", "inspect", "--format", f'{{{{ index .Config.Labels "{label}" }}}}', ref], quiet=True)
    if r.returncode != 0:
        return None
    value = r.stdout.strip()
    return "" if value in ("", "<no value>") else value


def image_exists(engine: str, ref: str) -> bool:
    return _run([engine, "image", "inspect", ref], quiet=True).returncode == 0


# -- base --------------------------------------------------------------------------------------
def _debootstrap(rootfs: Path) -> None:
    if os.geteuid() != 0:
        raise ImageError("debootstrap needs root (or pass --base with a Debian bookworm image your engine can pull)")
    if not shutil.which("debootstrap"):
        raise ImageError("debootstrap is not installed (apt-get install debootstrap)")
    _run(
        [
            "debootstrap",
            "--variant=minbase",
            "--include=ca-certificates",
            "bookworm",
            str(rootfs),
            DEBIAN_MIRROR,
        ],
        timeout=1800,
        stream=True,
    )
    # The image trusts what this host trusts: behind a TLS-inspecting egress, builds inside it
    # (pip, cargo) would otherwise fail certificate checks that pass on the host.
    extra = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    if extra:
        dest = rootfs / "usr/local/share/ca-certificates"
        dest.mkdir(parents=True, exist_ok=True)
        for crt in extra:
            shutil.copy2(crt, dest / crt.name)
        _run(["chroot", str(rootfs), "update-ca-certificates"])
    (rootfs / "etc/apt/sources.list").write_text(
        f"deb {DEBIAN_MIRROR} bookworm main\n"
        f"deb {DEBIAN_MIRROR} bookworm-updates main\n"
        f"deb {DEBIAN_MIRROR.replace('/debian', '/debian-security')} bookworm-security main\n"
    )
    (rootfs / "etc/apt/apt.conf.d/90kvwire").write_text(
        'APT::Install-Recommends "false";\nAPT::Install-Suggests "false";\n'
    )
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (rootfs / junk).glob("*"):
            if p.is_file():
                p.unlink()


def ensure_base(engine: str, base: str | None = None) -> str:
    """A Debian bookworm image ref to build FROM. `base` given: used as is (the engine pulls it)."""
    if base:
        return base
    if image_exists(engine, BASE_REF):
        return BASE_REF
    tarball = cache_dir() / "debian-bookworm-minbase.tar"
    if not tarball.exists():
        cache_dir().mkdir(parents=True, exist_ok=True)
        log.info("making a Debian bookworm base with debootstrap (first time only, ~1 min)")
        with tempfile.TemporaryDirectory(prefix="kvwire-rootfs-", dir=cache_dir()) as tmp:
            rootfs = Path(tmp) / "rootfs"
            _debootstrap(rootfs)
            partial = tarball.with_suffix(".tar.partial")
            _run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."])
            partial.rename(tarball)
    _run([engine, "import", "--change", 'CMD ["/bin/bash"]', str(tarball), BASE_REF], timeout=600)
    return BASE_REF


# -- builds ------------------------------------------------------------------------------------
def _digest(paths: Sequence[Path], extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for p in sorted(paths):
        h.update(p.name.encode())
        h.update(str(p.stat().st_size).encode() if p.suffix == ".jar" else p.read_bytes())
    return h.hexdigest()[:16]


def build(engine: str, ref: str, context: Path, *, base: str, args: dict[str, str], key: str) -> str:
    """Build unless an image with the same inputs (label `key`) is already there."""
    if key and image_label(engine, ref, CONTEXT_LABEL) == key:
        log.info("%s is up to date", ref)
        return ref
    cmd = [engine, "build", "--network", "host", "--build-arg", f"BASE={base}"]
    if key:
        cmd += ["--label", f"{CONTEXT_LABEL}={key}"]
    for k, v in args.items():
        cmd += ["--build-arg", f"{k}={v}"]
    _run([*cmd, "-t", ref, str(context)], timeout=1800, stream=True)
    return ref


def build_kafka(engine: str | None = None, base: str | None = None, libs: Path | None = None) -> str:
    """localhost/kvwire-kafka:<version> from the jars `kvwire kafka start` uses."""
    engine = engine or find_engine()
    libs = libs or LocalKafka().ensure_libs()
    jars = sorted(libs.glob("*.jar"))
    if not jars:
        raise ImageError(f"no broker jars in {libs}")
    base_ref = ensure_base(engine, base)
    files = [KAFKA_CONTEXT / "Dockerfile", KAFKA_CONTEXT / "run-kafka.sh"]
    key = _digest([*files, *jars], extra=base_ref)
    ref = kafka_ref()
    if image_label(engine, ref, CONTEXT_LABEL) == key:
        return ref
    with tempfile.TemporaryDirectory(prefix="kvwire-kafka-image-") as tmp:
        ctx = Path(tmp)
        for f in files:
            shutil.copy2(f, ctx / f.name)
        (ctx / "libs").mkdir()
        for jar in jars:
            try:  # same filesystem: no 40 MB copy
                os.link(jar, ctx / "libs" / jar.name)
            except OSError:
                shutil.copy2(jar, ctx / "libs" / jar.name)
        return build(engine, ref, ctx, base=base_ref, args={"KAFKA_VERSION": kafka_version()}, key=key)


def build_app(checkout: Path, engine: str | None = None, base: str | None = None) -> str:
    """localhost/kvwire:dev from a checkout's Dockerfile (the `index` and `demo` services)."""
    engine = engine or find_engine()
    if not (checkout / "Dockerfile").is_file():
        raise ImageError(f"no Dockerfile in {checkout}")
    base_ref = ensure_base(engine, base)
    # The engine's layer cache decides what to rebuild: a source change redoes only the install.
    return build(engine, APP_REF, checkout, base=base_ref, args={}, key="")
