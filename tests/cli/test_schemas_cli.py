"""`kvwire schemas`: every shipped version with its CRC-64-AVRO fingerprint, printed or exported.
The Java side of these fingerprints is checked in tests/interop/test_java_consumer.py."""

from __future__ import annotations

import json
from importlib import resources

import fastavro
from fastavro.schema import to_parsing_canonical_form
from typer.testing import CliRunner

from kvwire.cli import app
from kvwire.schemas_cli import shipped

SHIPPED = sorted(e.name for e in resources.files("schemas").joinpath("avro").iterdir() if e.name.endswith(".avsc"))


def _crc64_avro(data: bytes) -> int:
    # The spec's reference algorithm, written out so the test does not trust fastavro's byte order.
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for b in data:
        fp = (fp >> 8) ^ table[(fp ^ b) & 0xFF]
    return fp


def test_fingerprint_is_the_spec_crc64_of_the_canonical_form():
    found = shipped()
    assert [s.file for s in found] == sorted(SHIPPED, key=lambda n: int(n.split(".v")[1].split(".")[0]))
    for s in found:
        expected = _crc64_avro(to_parsing_canonical_form(json.loads(s.text)).encode())
        assert s.fingerprint == expected
        assert s.fingerprint_hex == f"{expected:016x}"
        assert s.header == b"\xc3\x01" + expected.to_bytes(8, "little")
    assert len({s.fingerprint for s in found}) == len(found)


def test_print_lists_every_version():
    res = CliRunner().invoke(app, ["schemas"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    found = shipped()
    assert len(lines) == len(found)
    for line, s in zip(lines, found, strict=False):
        assert line.startswith(f"v{s.version}  dev.kvwire.EventBatch/v{s.version}  fingerprint={s.fingerprint_hex}")
    assert lines[-1].endswith("(current)") and not any(x.endswith("(current)") for x in lines[:-1])


def test_out_writes_schemas_and_fingerprints(tmp_path):
    out = tmp_path / "contract"
    res = CliRunner().invoke(app, ["schemas", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == sorted([*SHIPPED, "fingerprints.json"])
    doc = json.loads((out / "fingerprints.json").read_text())
    assert doc["algorithm"] == "CRC-64-AVRO" and doc["current"] == shipped()[-1].version
    for entry in doc["versions"]:
        raw = json.loads((out / entry["file"]).read_text())
        fastavro.parse_schema(raw)  # the export is a usable schema, not just text
        fp = _crc64_avro(to_parsing_canonical_form(raw).encode())
        assert entry["fingerprint"] == f"{fp:016x}"
        assert entry["header"] == "c301" + fp.to_bytes(8, "little").hex()
        assert entry["name"] == f"dev.kvwire.EventBatch/v{entry['version']}"
    # Re-export over an existing directory is allowed (CI regenerates artefacts in place).
    assert CliRunner().invoke(app, ["schemas", "--out", str(out)]).exit_code == 0
