"""What `pip install kvwire` puts into site-packages: one import name, kvwire, and nothing of the
checkout's tooling (bench/, tests/)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (whl,) = out.glob("kvwire-*.whl")
    return whl


def test_wheel_holds_only_the_kvwire_namespace(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        tops = {n.split("/", 1)[0] for n in z.namelist()}
        names = z.namelist()
    assert {t for t in tops if not t.endswith((".dist-info", ".data"))} == {"kvwire"}
    # The layout's folders arrive under the namespace, with the contract's data files.
    for module in ("kvwire/schemas/codec.py", "kvwire/producer/publisher.py", "kvwire/consumer/index.py"):
        assert module in names
    assert any(n.startswith("kvwire/schemas/avro/") and n.endswith(".avsc") for n in names)
    assert not any(n.startswith(("bench/", "tests/", "kvwire/bench/")) for n in names)


def test_installing_the_wheel_adds_one_top_level_name(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    before = set(Path(purelib).iterdir())
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    added = {p.name for p in set(Path(purelib).iterdir()) - before}
    assert {n for n in added if not n.endswith(".dist-info")} == {"kvwire"}, added
    assert sysconfig.get_paths()["purelib"] != purelib  # really a separate environment
