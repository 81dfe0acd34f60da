"""kvwire's compatibility rule enforced by a real registry (Apicurio Registry 3.0.9 through its
Confluent-compatible API, started by the suite): `kvwire schemas --register` puts every shipped
version in under FULL_TRANSITIVE, and a change that breaks the rule is refused with 409, where
the registry's own default (NONE) would have taken it."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
from fastavro.schema import to_parsing_canonical_form
from schema_registry import fresh_subject
from typer.testing import CliRunner

from kvwire.cli import app
from kvwire.kafka.registry.client import IncompatibleSchema, RegistryClient, RegistryConfig
from kvwire.schemas.codec import CURRENT, VERSIONS

pytestmark = pytest.mark.integration  # a real registry, started by the suite


def _client(url: str) -> RegistryClient:
    return RegistryClient(RegistryConfig(url))


def _register_cli(url: str, subject: str):
    return CliRunner().invoke(app, ["schemas", "--register", url, "--subject", subject])


def _canonical(text: str) -> str:
    return to_parsing_canonical_form(json.loads(text))


def _with(fields_edit) -> str:
    raw = copy.deepcopy(CURRENT.raw)
    fields_edit(raw)
    return json.dumps(raw)


def _extra_keys_items(raw: dict) -> list:
    stored = raw["fields"][[f["name"] for f in raw["fields"]].index("events")]["type"]["items"][0]
    extra = next(f for f in stored["fields"] if f["name"] == "extra_keys")
    return extra["type"][1]["items"][1]["items"]


# Each breaks FULL (schemas/README.md), in a different direction.
INCOMPATIBLE = {
    # an old record has no value for it: backward-incompatible
    "field added without a default": lambda raw: raw["fields"].append({"name": "region", "type": "string"}),
    # old readers cannot fill a field without a default that new records lack: forward-incompatible
    "field without default removed": lambda raw: raw["fields"].remove(
        next(f for f in raw["fields"] if f["name"] == "seq")
    ),
    "field retyped": lambda raw: next(f for f in raw["fields"] if f["name"] == "gap").update(
        type="string", default="0"
    ),
    # a new extra-key branch no old branch can read (a float would be: it promotes to double):
    # an old reader fails on it, the README's "never in place" rule
    "union branch added": lambda raw: _extra_keys_items(raw).append({"type": "map", "values": "string"}),
}


def test_register_puts_every_version_in_order_under_full_transitive(schema_registry):
    subject = fresh_subject("register")
    res = _register_cli(schema_registry, subject)
    assert res.exit_code == 0, res.output
    client = _client(schema_registry)
    assert client.compatibility(subject) == "FULL_TRANSITIVE"
    assert client.versions(subject) == list(range(1, len(VERSIONS) + 1))
    lines = [line for line in res.stdout.splitlines() if line.startswith("v")]
    assert len(lines) == len(VERSIONS)
    ids = {}
    for line, (v, sv) in zip(lines, VERSIONS.items(), strict=True):
        fields = dict(part.split("=", 1) for part in line.split()[2:])
        assert line.startswith(f"v{v}  {sv.name.split('/')[0]}/v{v}") and fields["subject"] == subject
        ids[v] = int(fields["id"])
        # what the registry holds under that id is that version, byte for byte in meaning
        assert _canonical(client.schema(ids[v])) == sv.canonical
    assert len(set(ids.values())) == len(VERSIONS)
    # idempotent: the same ids, no new versions
    again = _register_cli(schema_registry, subject)
    assert again.exit_code == 0, again.output
    assert again.stdout == res.stdout
    assert client.versions(subject) == list(range(1, len(VERSIONS) + 1))


@pytest.mark.parametrize("change", sorted(INCOMPATIBLE))
def test_a_change_that_breaks_full_is_refused_with_409(schema_registry, change):
    client = _client(schema_registry)
    broken = _with(INCOMPATIBLE[change])
    enforced = fresh_subject("enforced")
    assert _register_cli(schema_registry, enforced).exit_code == 0
    with pytest.raises(IncompatibleSchema) as refused:
        client.register(enforced, broken)
    assert refused.value.status == 409
    assert client.versions(enforced) == list(range(1, len(VERSIONS) + 1))
    assert client.is_compatible(enforced, broken) is False
    # The oracle for "the rule is what refused it": under NONE (Apicurio's global default) the
    # same history takes the same change.
    open_subject = fresh_subject("none")
    for sv in VERSIONS.values():
        client.register(open_subject, sv.registry_text)
        client.set_compatibility(open_subject, "NONE")  # Apicurio takes NONE only for an existing subject
    client.register(open_subject, broken)
    assert len(client.versions(open_subject)) == len(VERSIONS) + 1


def test_a_change_that_keeps_full_is_accepted(schema_registry):
    client = _client(schema_registry)
    subject = fresh_subject("evolve")
    assert _register_cli(schema_registry, subject).exit_code == 0
    v_next = _with(lambda raw: raw["fields"].append({"name": "region", "type": "string", "default": ""}))
    assert client.is_compatible(subject, v_next) is True
    client.register(subject, v_next)
    assert len(client.versions(subject)) == len(VERSIONS) + 1


def test_register_fails_when_the_registry_refuses_a_version(schema_registry):
    # A subject whose history already holds a schema kvwire's versions cannot follow under FULL.
    client = _client(schema_registry)
    subject = fresh_subject("taken")
    client.register(subject, _with(lambda raw: raw["fields"].append({"name": "region", "type": "string"})))
    res = _register_cli(schema_registry, subject)
    assert res.exit_code == 1
    assert "409" in res.output and subject in res.output
    assert len(client.versions(subject)) == 1


def test_registry_cli_start_is_idempotent_and_prints_the_url_last(schema_registry):
    from kvwire.kafka.registry.local import LocalRegistry

    if LocalRegistry().url != schema_registry:
        pytest.skip("the suite uses an external registry (KVWIRE_SCHEMA_REGISTRY_URL)")
    cmd = [sys.executable, "-m", "kvwire.cli", "registry"]
    started = subprocess.run([*cmd, "start"], capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr
    assert started.stdout.splitlines()[-1] == schema_registry
    status = subprocess.run([*cmd, "status"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and status.stdout.startswith("running " + schema_registry)
