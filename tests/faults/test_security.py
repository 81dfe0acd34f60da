"""Kafka security end to end: a SCRAM-only broker (SASL_PLAINTEXT and SASL_SSL listeners), kvwire's
publisher, bridge and index connecting with credentials from the environment, clients without
them refused, and the password absent from every log line, HTTP answer and repr we produce.

The password is random per session (tests/faults/conftest.py), so a substring check is exact."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import msgspec
import pytest
import zmq
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError, SaslAuthenticationFailed
from oracle_feed import free_port

from kvwire.kafka.options import client_options_from_env, redact
from kvwire.kafka.positions import seek_to_beginning
from kvwire.producer.publisher import KafkaPublisher, PublisherConfig
from kvwire.schemas.codec import decode
from kvwire.schemas.events import WorkerId, stored

ROOT = Path(__file__).resolve().parents[2]
WRONG = "wrong-" + os.urandom(6).hex()


# ------------------------------------------------------------------ helpers


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    # DEBUG everywhere: a secret that leaks only in a debug line still leaks the day someone
    # turns debug on in production.
    caplog.set_level(logging.DEBUG)
    return caplog


def assert_secret_free(*texts: str, secrets: tuple[str, ...]) -> None:
    for i, text in enumerate(texts):
        for s in secrets:
            assert s not in text, f"secret found in output #{i}"


def brokers(k, tls: bool) -> str:
    if tls and k.ssl_bootstrap is None:
        pytest.fail("TLS listener was not configured", pytrace=False)
    return k.ssl_bootstrap if tls else k.sasl_bootstrap


async def read_batches(bootstrap: str, topic: str, opts: dict, until, limit_s: float = 30.0) -> list:
    """Decoded batches of partition 0 from the start until `until(batches)` holds.

    The limit guards against a hang; it is not a timing assertion."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest", **opts)
    await c.start()
    out: list = []
    try:
        tp = TopicPartition(topic, 0)
        c.assign([tp])
        await seek_to_beginning(c, tp)
        deadline = time.monotonic() + limit_s
        while not until(out):
            if time.monotonic() > deadline:
                raise AssertionError(f"gave up reading {topic}: {len(out)} batch(es) so far")
            for recs in (await c.getmany(timeout_ms=300)).values():
                out.extend(decode(r.value) for r in recs)
        return out
    finally:
        await c.stop()


async def end_offset(k, topic: str) -> int:
    c = AIOKafkaConsumer(bootstrap_servers=k.sasl_bootstrap, **client_options_from_env(k.env()))
    await c.start()
    try:
        tp = TopicPartition(topic, 0)
        return (await c.end_offsets([tp]))[tp]
    finally:
        await c.stop()


def has_events(batches) -> bool:
    return any(b.events for b in batches)


class Proc:
    """A kvwire command in a child process with its own environment; output goes to files so a
    chatty DEBUG log can never block it on a full pipe."""

    def __init__(self, tmp: Path, name: str, argv: list[str], env: dict[str, str]):
        self.out_path = tmp / f"{name}.out"
        self._out = open(self.out_path, "wb")  # noqa: SIM115 - the child process writes to it until stop()
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        # Only the broker credentials under test may reach the child.
        full_env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
        self.p = subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, env=full_env, stdout=self._out, stderr=subprocess.STDOUT
        )

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self, timeout: float = 20.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self._out.close()
        return self.p.returncode


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def publish(k, topic: str, worker: WorkerId, n: int, *, tls: bool = False) -> list:
    """n batches through KafkaPublisher, credentials taken the way a deployment gives them."""
    opts = client_options_from_env(k.env(tls=tls))
    pub = KafkaPublisher(
        PublisherConfig(
            bootstrap_servers=brokers(k, tls), topic=topic, partitions=1, heartbeat_interval_s=3600, client_options=opts
        )
    )
    try:
        st = pub.stream(worker, source="test")
        sent = [[stored([2 * i, 2 * i + 1], range(i, i + 8), 4, medium="GPU")] for i in range(n)]
        for ev in sent:
            assert st.publish(ev)
    finally:
        pub.close(timeout=30)
    (s,) = pub.stats()
    assert (s.acked, s.failed, s.dropped, s.lost) == (n + 1, 0, 0, 0), s  # +1: the epoch announcement
    # The config holds the password; its repr (what a careless log line prints) must not.
    assert_secret_free(repr(pub.config), str(pub.config), repr(pub.stats()), secrets=(k.password,))
    return sent


# ------------------------------------------------------------------ publisher


@pytest.mark.integration
@pytest.mark.parametrize("tls", [False, True], ids=["sasl_plaintext", "sasl_ssl"])
async def test_publisher_with_env_credentials_round_trips(secure_kafka, secure_topic, logs, tls):
    w = WorkerId(f"pub-{uuid.uuid4().hex[:6]}", 0, 0, 1, "m")
    sent = publish(secure_kafka, secure_topic, w, 3, tls=tls)
    opts = client_options_from_env(secure_kafka.env(tls=tls))
    got = await read_batches(
        brokers(secure_kafka, tls), secure_topic, opts, lambda bs: sum(1 for b in bs if b.events) >= 3
    )
    assert [list(b.events) for b in got if b.events] == sent
    assert {b.worker for b in got} == {w}
    assert_secret_free(logs.text, secrets=(secure_kafka.password,))


# ------------------------------------------------------------------ refusal


@pytest.mark.integration
@pytest.mark.parametrize("who", ["no_credentials", "wrong_password"])
async def test_client_without_valid_credentials_is_refused(secure_kafka, secure_topic, logs, who):
    opts = {} if who == "no_credentials" else client_options_from_env(secure_kafka.env(password=WRONG))
    # aiokafka turns every failed bootstrap into KafkaConnectionError; the cause is in its log:
    # a SASL listener drops a client that skips the handshake, and SCRAM answers a wrong proof
    # with error 58.
    cause = "closed" if who == "no_credentials" else SaslAuthenticationFailed.__name__
    for client in (
        AIOKafkaProducer(bootstrap_servers=secure_kafka.sasl_bootstrap, request_timeout_ms=5000, **opts),
        AIOKafkaConsumer(secure_topic, bootstrap_servers=secure_kafka.sasl_bootstrap, request_timeout_ms=5000, **opts),
    ):
        logs.clear()
        try:
            with pytest.raises(KafkaConnectionError, match="Unable to bootstrap"):
                await client.start()
        finally:
            await client.stop()
        assert cause in logs.text

    # kvwire's publisher does not raise into the engine: it keeps retrying, so what matters is
    # that nothing reached the topic.
    pub = KafkaPublisher(
        PublisherConfig(
            bootstrap_servers=secure_kafka.sasl_bootstrap,
            topic=secure_topic,
            partitions=1,
            heartbeat_interval_s=3600,
            retry_backoff_s=0.2,
            client_options=opts,
        )
    )
    try:
        st = pub.stream(WorkerId("refused"), source="test")
        st.publish([stored([1], range(4), 4)])
    finally:
        pub.close(timeout=3)
    (s,) = pub.stats()
    assert s.acked == 0, s
    assert await end_offset(secure_kafka, secure_topic) == 0
    assert_secret_free(logs.text, repr(pub.config), secrets=(secure_kafka.password, WRONG))


# ------------------------------------------------------------------ index


@pytest.mark.integration
async def test_index_builds_from_secure_topic_with_env_credentials(secure_kafka, secure_topic, tmp_path, logs):
    w = WorkerId(f"idx-{uuid.uuid4().hex[:6]}", 0, 0, 1, "m")
    publish(secure_kafka, secure_topic, w, 4)
    port = free_port()
    # index_cli.index is what `kvwire index` runs; called directly so this test does not depend
    # on how the root CLI mounts it. Snapshots stay on: the snapshot store is a third client
    # (admin + producer + consumer) that must carry the credentials too.
    proc = Proc(
        tmp_path,
        "index",
        [
            "-c",
            "import typer; from kvwire.index_cli import index; typer.run(index)",
            "-b",
            secure_kafka.sasl_bootstrap,
            "-t",
            secure_topic,
            "--http",
            f"127.0.0.1:{port}",
            "--log-level",
            "DEBUG",
        ],
        secure_kafka.env(),
    )
    base = f"http://127.0.0.1:{port}"

    def mine(workers_json: str) -> list:
        return [x for x in json.loads(workers_json)["workers"] if x["instance_id"] == w.instance_id]

    try:
        # /healthz alone is not enough: ingest reports ready for a moment while a partition
        # assignment is still being set up (targets not yet known), so also wait for the data.
        deadline = time.monotonic() + 45
        health = workers = ""
        while True:
            assert proc.alive(), f"index exited:\n{proc.output()[-3000:]}"
            assert time.monotonic() < deadline, f"index never caught up ({health} {workers}):\n{proc.output()[-3000:]}"
            await asyncio.sleep(0.3)
            try:
                hs, health = await asyncio.to_thread(http_get, base + "/healthz")
                ws, workers = await asyncio.to_thread(http_get, base + "/v1/workers")
            except OSError:
                continue
            if hs == 200 and ws == 200 and [x["blocks"] for x in mine(workers)] == [8]:  # 4 batches x 2 blocks
                break
        metrics_status, metrics = await asyncio.to_thread(http_get, base + "/metrics")
    finally:
        rc = proc.stop()
    out = proc.output()
    assert metrics_status == 200
    assert json.loads(health) == {"ready": True, "healthy": True}
    assert mine(workers)[0]["trusted"] is True
    assert "Authenticated as kvwire" in out  # it really spoke SCRAM, at DEBUG
    assert rc == 0, out[-3000:]
    assert_secret_free(out, health, workers, metrics, logs.text, secrets=(secure_kafka.password,))


# ------------------------------------------------------------------ bridge


def vllm_frame(seq: int, topic: bytes = b"") -> list[bytes]:
    """vLLM's ZmqEventPublisher frame: topic, big-endian seq, msgpack batch (0.26+ map shape)."""
    ev = {
        "type": "BlockStored",
        "block_hashes": [1000 + seq],
        "parent_block_hash": None,
        "token_ids": list(range(seq, seq + 4)),
        "block_size": 4,
        "medium": "GPU",
    }
    return [topic, seq.to_bytes(8, "big"), msgspec.msgpack.encode([1000.0 + seq, [ev], 0])]


@pytest.mark.integration
async def test_bridge_forwards_with_env_credentials(secure_kafka, secure_topic, tmp_path, logs):
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    zport = pub.bind_to_random_port("tcp://127.0.0.1")
    instance = f"br-{uuid.uuid4().hex[:6]}"
    proc = Proc(
        tmp_path,
        "bridge",
        [
            "-m",
            "kvwire.cli",
            "bridge",
            "--zmq-endpoint",
            f"tcp://127.0.0.1:{zport}",
            "--instance-id",
            instance,
            "--bootstrap-servers",
            secure_kafka.sasl_bootstrap,
            "--topic",
            secure_topic,
            "--partitions",
            "1",
            "--log-level",
            "DEBUG",
        ],
        secure_kafka.env(),
    )
    opts = client_options_from_env(secure_kafka.env())
    stop = asyncio.Event()

    async def engine() -> None:
        # PUB/SUB gives no sign that the subscription arrived: keep publishing as a live engine
        # does until the records show up in Kafka.
        seq = 0
        while not stop.is_set():
            pub.send_multipart(vllm_frame(seq))
            seq += 1
            await asyncio.sleep(0.1)

    task = asyncio.create_task(engine())
    try:
        got = await read_batches(secure_kafka.sasl_bootstrap, secure_topic, opts, has_events, limit_s=45)
    finally:
        stop.set()
        await task
        rc = proc.stop()
        pub.close()
        ctx.term()
    out = proc.output()
    assert {b.worker.instance_id for b in got} == {instance}
    assert any(e.token_ids.tolist()[:1] == [e.block_hashes[0] - 1000] for b in got for e in b.events)
    assert "Authenticated as kvwire" in out
    assert rc == 0, out[-3000:]
    assert_secret_free(out, logs.text, secrets=(secure_kafka.password,))


# ------------------------------------------------------------------ options (no broker)

SECRET = "s3cret-" + os.urandom(6).hex()
SASL_ENV = {
    "KVWIRE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
    "KVWIRE_KAFKA_SASL_USERNAME": "u",
    "KVWIRE_KAFKA_SASL_PASSWORD": SECRET,
}


def test_redact_and_repr_hide_the_password():
    opts = client_options_from_env(SASL_ENV)
    assert opts["sasl_plain_password"] == SECRET  # aiokafka gets the real value...
    assert redact(opts)["sasl_plain_password"] == "***"  # ...logs never do
    assert redact({"nested": {"sasl_plain_password": "p"}, "sasl_oauth_token_provider": object()}) == {
        "nested": {"sasl_plain_password": "***"},
        "sasl_oauth_token_provider": "***",
    }
    cfg = PublisherConfig(client_options=opts)
    assert_secret_free(repr(opts), str(opts), f"{opts}", repr(cfg), repr(redact(opts)), secrets=(SECRET,))
    assert dict(**opts)["sasl_plain_password"] == SECRET  # still unpacks as kwargs


@pytest.mark.parametrize(
    "env, names",
    [
        ({"KVWIRE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, ["KVWIRE_KAFKA_SASL_USERNAME", "KVWIRE_KAFKA_SASL_PASSWORD"]),
        (
            {"KVWIRE_KAFKA_SECURITY_PROTOCOL": "sasl_plaintext", "KVWIRE_KAFKA_SASL_USERNAME": "u"},
            ["KVWIRE_KAFKA_SASL_PASSWORD"],
        ),
        ({"KVWIRE_KAFKA_SECURITY_PROTOCOL": "TLS"}, ["KVWIRE_KAFKA_SECURITY_PROTOCOL"]),
        (
            {
                "KVWIRE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
                "KVWIRE_KAFKA_SASL_MECHANISM": "GSSAPI",
                "KVWIRE_KAFKA_SASL_USERNAME": "u",
                "KVWIRE_KAFKA_SASL_PASSWORD": SECRET,
            },
            ["KVWIRE_KAFKA_SASL_MECHANISM"],
        ),
    ],
)
def test_misconfiguration_fails_early_without_echoing_secrets(env, names):
    # Half-configured SASL would otherwise surface only as an opaque connection error at runtime.
    with pytest.raises(ValueError) as e:
        client_options_from_env(env)
    for n in names:
        assert n in str(e.value)
    assert_secret_free(str(e.value), secrets=(SECRET,))


def test_plaintext_is_the_default():
    assert client_options_from_env({}) == {}
    assert client_options_from_env({"KVWIRE_KAFKA_SECURITY_PROTOCOL": "plaintext"}) == {}


# ------------------------------------------------------------------ standard client properties, mTLS


def write_properties(path: Path, props: dict[str, str]) -> Path:
    path.write_text(
        "# as an operator writes it for any Kafka client\n" + "".join(f"{k}={v}\n" for k, v in props.items())
    )
    return path


def need_mtls(k) -> None:
    if k.mtls_bootstrap is None:
        pytest.fail("the mTLS listener was not configured", pytrace=False)


@pytest.mark.integration
async def test_mtls_client_certificate_from_a_properties_file_round_trips(secure_kafka, secure_topic, tmp_path, logs):
    from kvwire.kafka.options import client_options

    need_mtls(secure_kafka)
    props = write_properties(tmp_path / "client.properties", secure_kafka.mtls_properties())
    opts = client_options(props, env={})
    w = WorkerId(f"mtls-{uuid.uuid4().hex[:6]}", 0, 0, 1, "m")
    pub = KafkaPublisher(
        PublisherConfig(
            bootstrap_servers=secure_kafka.mtls_bootstrap,
            topic=secure_topic,
            partitions=1,
            heartbeat_interval_s=3600,
            client_options=opts,
        )
    )
    try:
        st = pub.stream(w, source="test")
        sent = [[stored([7, 8], range(8), 4, medium="GPU")]]
        assert st.publish(sent[0])
    finally:
        pub.close(timeout=30)
    (s,) = pub.stats()
    assert (s.acked, s.failed, s.dropped, s.lost) == (2, 0, 0, 0), s
    got = await read_batches(
        secure_kafka.mtls_bootstrap, secure_topic, opts, lambda bs: any(b.events and b.worker == w for b in bs)
    )
    assert [list(b.events) for b in got if b.worker == w and b.events] == sent
    # The key's password went to the TLS layer only.
    assert_secret_free(logs.text, repr(opts), repr(pub.config), secrets=(secure_kafka.key_password,))


@pytest.mark.integration
@pytest.mark.parametrize("who", ["no_certificate", "unknown_ca"])
async def test_mtls_refuses_a_client_without_a_trusted_certificate(secure_kafka, secure_topic, who):
    from kvwire.kafka.options import aiokafka_options

    need_mtls(secure_kafka)
    if who == "no_certificate":
        props = {"security.protocol": "SSL", "ssl.ca.location": secure_kafka.cafile}
    else:
        props = secure_kafka.mtls_properties(cert=secure_kafka.rogue_cert, key=secure_kafka.rogue_key)
    c = AIOKafkaConsumer(
        bootstrap_servers=secure_kafka.mtls_bootstrap, request_timeout_ms=5000, **aiokafka_options(props)
    )
    with pytest.raises(KafkaConnectionError):
        await c.start()
    await c.stop()


@pytest.mark.integration
async def test_tail_reads_with_a_jaas_line_from_a_properties_file(secure_kafka, secure_topic, tmp_path):
    w = WorkerId(f"tail-{uuid.uuid4().hex[:6]}", 0, 0, 1, "m")
    publish(secure_kafka, secure_topic, w, 2)
    jaas = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{secure_kafka.user}" password="{secure_kafka.password}";'
    )
    props = write_properties(
        tmp_path / "client.properties",
        {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256", "sasl.jaas.config": jaas},
    )
    proc = Proc(
        tmp_path,
        "tail",
        [
            "-m",
            "kvwire.cli",
            "tail",
            "--bootstrap-servers",
            secure_kafka.sasl_bootstrap,
            "--topic",
            secure_topic,
            "--from",
            "earliest",
            "--json",
            "--worker",
            w.instance_id,
            "--max-records",
            "3",
            "--timeout",
            "30",
            "--kafka-config",
            str(props),
        ],
        {},  # nothing in the environment: the file is the only source of credentials
    )
    rc = await asyncio.to_thread(proc.p.wait, 90)
    proc.stop()
    out = proc.output()
    assert rc == 0, out[-3000:]
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert len(lines) == 3, out[-3000:]  # the epoch announcement and two batches
    assert_secret_free(out, secrets=(secure_kafka.password,))


def test_standard_property_names_from_the_environment_map_to_aiokafka(tmp_path):
    from kvwire.kafka.options import client_options_from_env

    env = {
        "KVWIRE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "KVWIRE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
        "KVWIRE_KAFKA_SASL_JAAS_CONFIG": f'x.ScramLoginModule required username="u" password="{SECRET}";',
        "KVWIRE_KAFKA_CLIENT_ID": "router-7",
        "KVWIRE_KAFKA_HOME": "/not/a/client/property",  # the local broker's setting, never a property
    }
    opts = client_options_from_env(env)
    assert opts["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (opts["sasl_plain_username"], opts["sasl_plain_password"]) == ("u", SECRET)
    assert opts["client_id"] == "router-7" and opts["security_protocol"] == "SASL_SSL"
    assert opts["ssl_context"].check_hostname is True
    assert_secret_free(repr(opts), secrets=(SECRET,))


def test_a_properties_file_is_overridden_by_the_environment(tmp_path):
    from kvwire.kafka.options import client_properties

    f = write_properties(tmp_path / "p.properties", {"security.protocol": "SSL", "client.id": "from-file"})
    props = client_properties({"KVWIRE_KAFKA_CONFIG": str(f), "KVWIRE_KAFKA_CLIENT_ID": "from-env"})
    assert props == {"security.protocol": "SSL", "client.id": "from-env"}


@pytest.mark.parametrize(
    "props, names",
    [
        ({"security.protocol": "SSL", "ssl.truststore.location": "/x.jks"}, ["ssl.truststore.location", "PEM"]),
        ({"security.protocol": "SSL", "ssl.key.location": "/k.pem"}, ["ssl.certificate.location"]),
        ({"security.protocol": "SSL", "ssl.ca.location": "/does/not/exist.pem"}, ["ssl.ca.location"]),
        ({"request.timeout.ms": "soon"}, ["request.timeout.ms"]),
    ],
)
def test_bad_tls_properties_fail_early_naming_the_property(props, names):
    from kvwire.kafka.options import aiokafka_options

    with pytest.raises(ValueError) as e:
        aiokafka_options(props)
    for n in names:
        assert n in str(e.value)


def test_unknown_property_is_named_but_its_value_is_not_logged(logs):
    from kvwire.kafka.options import aiokafka_options

    assert aiokafka_options({"sasl.oauthbearer.token": SECRET}) == {}
    assert "sasl.oauthbearer.token" in logs.text
    assert_secret_free(logs.text, secrets=(SECRET,))


def test_connector_config_goes_through_the_same_helper(tmp_path, monkeypatch):
    from kvwire.kafka.options import connector_client_options

    monkeypatch.setenv("KVWIRE_KAFKA_CLIENT_ID", "from-env")
    f = write_properties(tmp_path / "c.properties", {"security.protocol": "SASL_PLAINTEXT", "sasl.username": "u"})
    extra = {
        "kafka_config": str(f),
        "kafka_properties": {"sasl.password": SECRET, "sasl.mechanism": "PLAIN"},
        "publisher": {"client_options": {"request_timeout_ms": 1234}},  # aiokafka keywords, as before
    }
    opts = connector_client_options(extra)
    assert opts["security_protocol"] == "SASL_PLAINTEXT" and opts["sasl_mechanism"] == "PLAIN"
    assert (opts["sasl_plain_username"], opts["sasl_plain_password"]) == ("u", SECRET)
    assert opts["client_id"] == "from-env" and opts["request_timeout_ms"] == 1234
    assert_secret_free(repr(opts), secrets=(SECRET,))
