"""The registry client's configuration: one URL, basic-auth credentials from the environment only,
and never a password in a repr, a log line or an error. The HTTP side of it is checked against a
recording HTTP endpoint here (what the client sends), and against the real registry everywhere
else in tests/registry."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from kvwire.kafka.registry.client import NotFound, RegistryClient, RegistryConfig, RegistryError, RegistryUnavailable
from kvwire.kafka.registry.resolver import IdResolver
from kvwire.producer.config import PublisherConfig
from kvwire.schemas.codec import CURRENT, SchemaIds, encode

SECRET = "s3cr3t-pa55"


def test_config_is_one_url_with_credentials_from_the_environment():
    assert RegistryConfig.from_env(env={}) is None
    cfg = RegistryConfig.from_env(
        env={
            "KVWIRE_SCHEMA_REGISTRY_URL": "https://sr.example:8081/",
            "KVWIRE_SCHEMA_REGISTRY_USERNAME": "svc",
            "KVWIRE_SCHEMA_REGISTRY_PASSWORD": SECRET,
        }
    )
    assert cfg is not None and cfg.url == "https://sr.example:8081" and cfg.username == "svc"
    assert SECRET not in repr(cfg) and SECRET not in repr(RegistryClient(cfg)) and SECRET not in str(cfg)
    # an explicit URL wins over the environment's, credentials still come from the environment
    assert RegistryConfig.from_env("http://other:1", env={"KVWIRE_SCHEMA_REGISTRY_URL": "http://x:2"}).url == (
        "http://other:1"
    )
    with pytest.raises(ValueError, match="both"):
        RegistryConfig.from_env("http://r:1", env={"KVWIRE_SCHEMA_REGISTRY_USERNAME": "svc"})
    with pytest.raises(ValueError) as e:
        RegistryConfig(f"http://svc:{SECRET}@r:1")
    assert SECRET not in str(e.value)
    with pytest.raises(ValueError):
        RegistryConfig("r:8081")


def test_confluent_framing_needs_a_registry(monkeypatch):
    monkeypatch.delenv("KVWIRE_SCHEMA_REGISTRY_URL", raising=False)
    with pytest.raises(ValueError, match="schema_registry_url"):
        PublisherConfig(framing="confluent")
    with pytest.raises(ValueError, match="framing"):
        PublisherConfig(framing="avro")
    monkeypatch.setenv("KVWIRE_SCHEMA_REGISTRY_URL", "http://r:1")
    assert PublisherConfig(framing="confluent").framing == "confluent"


class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[dict]] = []
    routes: ClassVar[dict[str, tuple[int, dict]]] = {}

    def do_GET(self) -> None:
        type(self).seen.append({"path": self.path, "auth": self.headers.get("Authorization")})
        status, body = type(self).routes.get(self.path, (404, {"error_code": 40403, "message": "not found"}))
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/vnd.schemaregistry.v1+json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    _Recorder.seen = []
    _Recorder.routes = {
        "/p/schemas/ids/1": (200, {"schema": CURRENT.registry_text}),
        "/p/schemas/ids/2": (200, {"schema": '{"type":"record","name":"Other","fields":[]}'}),
        "/p/schemas/ids/3": (503, {"message": "down"}),
        "/p/schemas/ids/4": (401, {"message": "unauthorized"}),
    }
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/p"
    server.shutdown()
    server.server_close()


def test_basic_auth_is_sent_and_never_shown(recorder, caplog):
    import base64

    client = RegistryClient(RegistryConfig(recorder, "svc", SECRET))
    assert client.schema(1) == CURRENT.registry_text
    assert _Recorder.seen[-1]["auth"] == "Basic " + base64.b64encode(f"svc:{SECRET}".encode()).decode()
    with pytest.raises(NotFound):
        client.schema(99)
    with pytest.raises(RegistryUnavailable):
        client.schema(3)
    with pytest.raises(RegistryError) as e:
        client.schema(4)
    assert e.value.status == 401 and SECRET not in str(e.value)

    # The resolver: a verdict is cached with its reason; an outage is not a verdict.
    ids = SchemaIds()
    resolver = IdResolver(client, ids)
    with caplog.at_level(logging.DEBUG):
        resolver.resolve({1, 2, 99})
        with pytest.raises(RegistryUnavailable):
            resolver.resolve({3})
    assert ids.get(1) is CURRENT
    assert "not dev.kvwire.EventBatch" in (ids.refusal(2) or "")
    assert "is not known to the schema registry" in (ids.refusal(99) or "")
    assert not ids.known(3)
    assert ids.missing([encode(_batch(), schema_id=3)]) == {3}
    assert SECRET not in caplog.text


def _batch():
    from kvwire.schemas.events import EventBatch, WorkerId

    return EventBatch(WorkerId("w"), 1, 0, 0)
