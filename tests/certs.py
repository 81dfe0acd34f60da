"""Certificates for the tests' TLS endpoints (the secure broker, the HTTP API): made fresh per run."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def self_signed(home: Path) -> tuple[Path, Path]:
    """A CA-less self-signed cert for 127.0.0.1/localhost; the broker reads it as a PEM keystore
    (key PKCS#8 unencrypted + cert in one file), clients trust the cert itself as their CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        # Python's default context rejects a self-signed leaf used as its own anchor unless it is a CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    keystore, ca = home / "broker.pem", home / "ca.pem"
    keystore.write_bytes(key_pem + cert_pem)
    keystore.chmod(0o600)
    ca.write_bytes(cert_pem)
    return keystore, ca


def client_certs(home: Path, key_password: str) -> dict[str, str]:
    """A client CA the mTLS listener trusts, a client certificate it signed (key encrypted with
    ``key_password``, as keys at rest should be), and a rogue certificate from an unknown CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool):
        b = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(issuer))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    out: dict[str, str] = {}
    for label, ca_name, password in (("client", "kvwire-test-client-ca", key_password), ("rogue", "unknown-ca", None)):
        ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
        ca_cert = cert(ca_name, ca_key, ca_name, ca_key, True)
        leaf = cert(f"kvwire-{label}", key, ca_name, ca_key, False)
        enc = serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption()
        paths = {
            "ca": home / f"{label}-ca.pem",
            "cert": home / f"{label}.pem",
            "key": home / f"{label}.key",
        }
        paths["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        paths["cert"].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
        paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc))
        paths["key"].chmod(0o600)
        out.update({f"{label}_{k}": str(v) for k, v in paths.items()})
    return out
