"""`kvwire schemas [--out DIR] [--register URL]`: the shipped contract, as other languages and
schema registries need it.

Fingerprints are computed here from the .avsc text itself, not taken from the codec, so this
command is an independent check of what the codec frames records with. The hex is the one Java's
``SchemaNormalization.parsingFingerprint64`` prints (``%016x`` of the long); the wire header carries
the same long little-endian (Avro single-object encoding), shown as ``header``.

``--register URL`` puts every version, oldest first, into a schema registry (Confluent's, or
Apicurio's ccompat API) under one subject with FULL_TRANSITIVE compatibility, so the registry
itself enforces kvwire's rule from then on. Credentials come from the environment
(KVWIRE_SCHEMA_REGISTRY_USERNAME / _PASSWORD).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import typer

from kvwire.cli_failure import BadSetting, one_line
from kvwire.cli_options import DEFAULT_TOPIC, Topic

app = typer.Typer(help="Print or export every kvwire schema version with its fingerprint.")

_FILE = re.compile(r"event_batch\.v(\d+)\.avsc")


@dataclass(frozen=True)
class ShippedSchema:
    version: int
    file: str
    text: str
    canonical: str
    fingerprint: int  # CRC-64-AVRO as an unsigned 64-bit number

    @property
    def fingerprint_hex(self) -> str:
        return f"{self.fingerprint:016x}"

    @property
    def header(self) -> bytes:
        return b"\xc3\x01" + self.fingerprint.to_bytes(8, "little")

    @property
    def name(self) -> str:
        return f"dev.kvwire.EventBatch/v{self.version}"


def shipped() -> list[ShippedSchema]:
    """Every version in schemas/avro, oldest first."""
    from fastavro.schema import fingerprint, to_parsing_canonical_form

    out = []
    for entry in resources.files("kvwire.schemas").joinpath("avro").iterdir():
        m = _FILE.fullmatch(entry.name)
        if not m:
            continue
        text = entry.read_text()
        canonical = to_parsing_canonical_form(json.loads(text))
        # fastavro hex-encodes the fingerprint's little-endian bytes (as Java's byte[] API does).
        fp = int.from_bytes(bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO")), "little")
        out.append(ShippedSchema(int(m.group(1)), entry.name, text, canonical, fp))
    return sorted(out, key=lambda s: s.version)


def fingerprints_doc(schemas: list[ShippedSchema]) -> dict[str, Any]:
    return {
        "algorithm": "CRC-64-AVRO",
        "encoding": "Avro single-object: C3 01 + fingerprint (8 bytes, little-endian) + body",
        "fingerprint_format": "hex of the unsigned 64-bit value, as Java's parsingFingerprint64 with %016x",
        "current": schemas[-1].version,
        "versions": [
            {
                "version": s.version,
                "name": s.name,
                "file": s.file,
                "fingerprint": s.fingerprint_hex,
                "header": s.header.hex(),
            }
            for s in schemas
        ],
    }


@app.callback(invoke_without_command=True)
def schemas(
    out: Path | None = typer.Option(
        None, "--out", help="write DIR/event_batch.vN.avsc and DIR/fingerprints.json instead of printing"
    ),
    register: str | None = typer.Option(
        None,
        "--register",
        metavar="URL",
        help="register every version, oldest first, with FULL_TRANSITIVE compatibility, in the schema registry at URL",
    ),
    topic: Topic = DEFAULT_TOPIC,
    subject: str | None = typer.Option(None, "--subject", help="with --register: this subject instead"),
) -> None:
    """Every schema version with its CRC-64-AVRO fingerprint (newest is the current writer)."""
    if register is not None:
        with one_line("schemas --register"):
            _register(register, subject or f"{topic}-value")
        return
    found = shipped()
    if out is None:
        current = found[-1].version
        for s in found:
            mark = "  (current)" if s.version == current else ""
            typer.echo(f"v{s.version}  {s.name}  fingerprint={s.fingerprint_hex}  header={s.header.hex()}{mark}")
        return
    out.mkdir(parents=True, exist_ok=True)
    for s in found:
        (out / s.file).write_text(s.text)
    (out / "fingerprints.json").write_text(json.dumps(fingerprints_doc(found), indent=2) + "\n")
    typer.echo(f"wrote {len(found)} schemas and fingerprints.json to {out}")


def _register(url: str, subject: str) -> None:
    from kvwire.kafka.registry.client import KVWIRE_COMPATIBILITY, RegistryClient, RegistryConfig
    from kvwire.kafka.registry.shipped import register_shipped

    try:
        cfg = RegistryConfig.from_env(url)
    except ValueError as e:
        raise BadSetting(str(e)) from None
    assert cfg is not None
    ids = register_shipped(RegistryClient(cfg), subject)
    for version, sid in ids:
        typer.echo(f"v{version}  dev.kvwire.EventBatch/v{version}  subject={subject}  id={sid}")
    typer.echo(f"{subject}: {len(ids)} versions, compatibility {KVWIRE_COMPATIBILITY}", err=True)


if __name__ == "__main__":
    app()
