"""The fault suite's own brokers, from one factory (:class:`PrivateBrokers`): a secured broker
for the security tests (SASL_PLAINTEXT, SASL_SSL and an mTLS listener, SSL with client
certificates required, signed by a test CA), the three-broker cluster for the replication faults,
and single brokers that a test may kill.

Each is a LocalKafka of its own (own home, own ports): the shared broker on 19092 must stay
PLAINTEXT for every other test and is never killed, and a broker's listeners cannot be changed
while it runs."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from certs import client_certs, self_signed
from ci_env import in_ci, need_java_and_mvn, unavailable

from kvwire.kafka.broker.probe import run_sync

if TYPE_CHECKING:
    from kvwire.kafka.broker import LocalKafka
    from kvwire.kafka.broker.cluster import LocalCluster

USER = "kvwire"
# Random per session so a leak check cannot pass by luck of a value that never reached the client.
PASSWORD = "pw-" + os.urandom(12).hex()
ADMIN_USER = "kvwire-broker"
ADMIN_PASSWORD = "adm-" + os.urandom(12).hex()
MECH = "SCRAM-SHA-256"
KEY_PASSWORD = "key-" + os.urandom(12).hex()


@dataclass(frozen=True)
class SecureKafka:
    sasl_bootstrap: str  # SASL_PLAINTEXT
    ssl_bootstrap: str | None  # SASL_SSL; None when TLS could not be set up
    cafile: str | None
    log_path: Path
    user: str = USER
    password: str = PASSWORD
    mtls_bootstrap: str | None = None  # SSL, client certificate required
    client_cert: str | None = None  # signed by the CA the mTLS listener trusts
    client_key: str | None = None  # encrypted with key_password
    key_password: str = KEY_PASSWORD
    rogue_cert: str | None = None  # a certificate from a CA the broker does not know
    rogue_key: str | None = None

    def mtls_properties(self, *, cert: str | None = None, key: str | None = None) -> dict[str, str]:
        """Standard Kafka client properties for the mTLS listener, as an operator writes them."""
        props = {"security.protocol": "SSL", "ssl.ca.location": self.cafile or ""}
        cert, key = cert or self.client_cert, key or self.client_key
        if cert:
            props.update({"ssl.certificate.location": cert, "ssl.key.location": key or ""})
            if key == self.client_key:
                props["ssl.key.password"] = self.key_password
        return props

    def env(self, *, tls: bool = False, password: str | None = None) -> dict[str, str]:
        """KVWIRE_KAFKA_* variables as a deployment would set them."""
        env = {
            "KVWIRE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL" if tls else "SASL_PLAINTEXT",
            "KVWIRE_KAFKA_SASL_MECHANISM": MECH,
            "KVWIRE_KAFKA_SASL_USERNAME": self.user,
            "KVWIRE_KAFKA_SASL_PASSWORD": self.password if password is None else password,
        }
        if tls:
            env["KVWIRE_KAFKA_SSL_CAFILE"] = self.cafile or ""
        return env


def _jaas(user: str, password: str) -> str:
    return f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{user}" password="{password}";'


def secure_broker_config(port: int, keystore: Path | None, client_ca: str | None = None) -> tuple[dict, list[str]]:
    """(extra_properties, format_args) for a broker whose client listeners all require SCRAM.

    The controller listener stays PLAINTEXT (loopback, never advertised to clients). Inter-broker
    traffic goes over the SASL listener with its own user: a PLAINTEXT inter-broker listener
    would be an unauthenticated door for any client that finds the port."""
    c, s = port + 1, port + 2
    listeners = [f"SASL://127.0.0.1:{port}", f"CONTROLLER://127.0.0.1:{c}"]
    advertised = [f"SASL://127.0.0.1:{port}"]
    proto_map = ["SASL:SASL_PLAINTEXT", "CONTROLLER:PLAINTEXT"]
    props: dict = {
        "inter.broker.listener.name": "SASL",
        "sasl.enabled.mechanisms": MECH,
        "sasl.mechanism.inter.broker.protocol": MECH,
        "listener.name.sasl.scram-sha-256.sasl.jaas.config": _jaas(ADMIN_USER, ADMIN_PASSWORD),
    }
    if keystore is not None:
        listeners.append(f"SASLSSL://127.0.0.1:{s}")
        advertised.append(f"SASLSSL://127.0.0.1:{s}")
        proto_map.append("SASLSSL:SASL_SSL")
        props.update(
            {
                "listener.name.saslssl.scram-sha-256.sasl.jaas.config": _jaas(ADMIN_USER, ADMIN_PASSWORD),
                "listener.name.saslssl.ssl.keystore.type": "PEM",
                "listener.name.saslssl.ssl.keystore.location": str(keystore),
                "listener.name.saslssl.ssl.client.auth": "none",
            }
        )
    if keystore is not None and client_ca is not None:
        # mTLS: the client certificate is the credential; SSL principals need no SASL user.
        listeners.append(f"MTLS://127.0.0.1:{port + 3}")
        advertised.append(f"MTLS://127.0.0.1:{port + 3}")
        proto_map.append("MTLS:SSL")
        props.update(
            {
                "listener.name.mtls.ssl.keystore.type": "PEM",
                "listener.name.mtls.ssl.keystore.location": str(keystore),
                "listener.name.mtls.ssl.truststore.type": "PEM",
                "listener.name.mtls.ssl.truststore.location": client_ca,
                "listener.name.mtls.ssl.client.auth": "required",
            }
        )
    props.update(
        {
            "listeners": ",".join(listeners),
            "advertised.listeners": ",".join(advertised),
            "listener.security.protocol.map": ",".join(proto_map),
        }
    )
    # SCRAM users live in the cluster metadata; adding them at format time means the broker
    # accepts them from its first second, with no admin round trip before it is reachable.
    fmt = [
        "--add-scram",
        f"{MECH}=[name={ADMIN_USER},password={ADMIN_PASSWORD}]",
        "--add-scram",
        f"{MECH}=[name={USER},password={PASSWORD}]",
    ]
    return props, fmt


def client_config(bootstrap_env: dict[str, str]) -> dict:
    from kvwire.kafka.options import client_options_from_env

    return client_options_from_env(bootstrap_env)


@pytest.fixture(scope="session")
def secure_kafka(private_brokers: PrivateBrokers) -> SecureKafka:
    """Started once per session, killed (and its temp home dropped) at the end."""
    home = private_brokers.home("sasl-kafka")
    # p: SASL, p+1: controller, p+2: SASL_SSL, p+3: mTLS
    port = int(os.environ.get("KVWIRE_SASL_KAFKA_PORT") or free_port_run(4))
    tls_error = None
    certs: dict[str, str] = {}
    try:
        keystore, ca = self_signed(home)
        certs = client_certs(home, KEY_PASSWORD)
    except Exception as e:  # cryptography missing: SASL still gets tested
        keystore = ca = None
        tls_error = e
    props, fmt = secure_broker_config(port, keystore, certs.get("client_ca"))
    info = SecureKafka(
        f"127.0.0.1:{port}",
        f"127.0.0.1:{port + 2}" if keystore else None,
        str(ca) if ca else None,
        home / "kafka.log",
        mtls_bootstrap=f"127.0.0.1:{port + 3}" if certs else None,
        client_cert=certs.get("client_cert"),
        client_key=certs.get("client_key"),
        rogue_cert=certs.get("rogue_cert"),
        rogue_key=certs.get("rogue_key"),
    )
    private_brokers.single(
        "SASL broker",
        home=home,
        port=port,
        extra_properties=props,
        format_args=fmt,
        client_config=client_config(info.env()),
    )
    if tls_error is not None and in_ci():
        pytest.fail(f"TLS keystore could not be made: {tls_error}", pytrace=False)
    return info


@pytest.fixture
def secure_topic(secure_kafka: SecureKafka, request: pytest.FixtureRequest) -> str:
    """A fresh 1-partition topic created with credentials (auto-create would hide auth failures)."""
    import uuid

    from kafka_admin import create_topics

    name = f"sec-{request.node.name[:40]}-{uuid.uuid4().hex[:8]}".replace("[", "-").replace("]", "")
    run_sync(
        lambda: create_topics(secure_kafka.sasl_bootstrap, [name], 1, client_options=client_config(secure_kafka.env()))
    )
    return name


def free_port_run(n: int) -> int:
    """p..p+n-1 all free on 127.0.0.1 (a cluster's brokers and controllers)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + n - 1 > 65535:
            continue
        ok = True
        for q in range(p, p + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
                    break
        if ok:
            return p
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


class PrivateBrokers:
    """Starts brokers of the fault tests' own; every one it started is killed when the session
    ends (their data are temp dirs: no controlled shutdown needed). A start that fails fails the
    test under CI and skips it elsewhere, like any missing broker."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self._tmp = tmp
        self._started: list[LocalKafka | LocalCluster] = []

    def home(self, name: str) -> Path:
        return self._tmp.mktemp(name)

    def single(self, what: str = "private broker", *, home: Path | None = None, port: int | None = None, **options):
        """A started single broker (kvwire.kafka.broker.LocalKafka; options are its keywords). A test
        that kills it must stop it itself when done: it is its own, not the session's."""
        from kvwire.kafka.broker import LocalKafka

        need_java_and_mvn(f"a {what}")
        kafka = LocalKafka(home or self.home("kafka"), port or free_port_run(2), **options)
        self._start(kafka, what)
        return kafka

    def cluster(self, brokers: int = 3):
        """A started multi-broker KRaft cluster (kvwire.kafka.broker.cluster.LocalCluster)."""
        from kvwire.kafka.broker.cluster import LocalCluster

        what = f"{brokers}-broker cluster"
        need_java_and_mvn(f"a {what}")
        cluster = LocalCluster(self.home("kafka-cluster"), free_port_run(2 * brokers), brokers)
        self._start(cluster, what)
        return cluster

    def _start(self, broker: LocalKafka | LocalCluster, what: str) -> None:
        self._started.append(broker)
        try:
            broker.start()
        except Exception as e:
            broker.kill()
            unavailable(f"{what} could not start: {e}")

    def kill_all(self) -> None:
        for broker in reversed(self._started):
            try:
                broker.kill()
            except Exception:
                pass  # teardown: one broker that cannot be killed must not leave the others up


@pytest.fixture(scope="session")
def private_brokers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateBrokers]:
    """The one factory of the fault suite's own brokers and clusters."""
    brokers = PrivateBrokers(tmp_path_factory)
    try:
        yield brokers
    finally:
        brokers.kill_all()


@pytest.fixture(scope="session")
def kafka_cluster(private_brokers: PrivateBrokers):
    """A private three-broker KRaft cluster (kvwire.kafka.broker.cluster) for the replication faults.
    Tests that kill or restart a node must leave all three running again."""
    return private_brokers.cluster(3)
