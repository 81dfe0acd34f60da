"""Who may connect to the HTTP API: bearer token, TLS, client certificates, and peers through them."""

from __future__ import annotations

import ssl
from pathlib import Path

import aiohttp
import pytest
from certs import client_certs, self_signed

from kvwire.consumer.apply import Applier
from kvwire.consumer.http import bound_port, make_app, serve
from kvwire.consumer.http_security import HttpSecurity, SecurityConfigError
from kvwire.schemas.events import EventBatch, WorkerId, stored

KEY_PASSWORD = "test-key-password"
PROMPT = {"token_ids": list(range(32))}


def applier(inst: str) -> Applier:
    a = Applier()
    a.apply_batch(EventBatch(WorkerId(inst), 1, 0, 1, (stored([1, 2], range(32), 16),), reset=True))
    return a


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("pki")
    server_pem, server_ca = self_signed(home)
    out = {"server": str(server_pem), "server_ca": str(server_ca), **client_certs(home, KEY_PASSWORD)}
    # The member's own client identity for its peers: a certificate the client CA signed, key in clear.
    out["token"] = str(home / "token")
    Path(out["token"]).write_text("s3cret-token\n")
    return out


async def started(app, security: HttpSecurity | None):
    runner = await serve(app, "127.0.0.1", 0, tls=security.server_context() if security else None)
    return runner, bound_port(runner)


def client_tls(pki: dict[str, str], cert: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki["server_ca"])
    if cert is not None:
        ctx.load_cert_chain(
            pki[f"{cert}_cert"], pki[f"{cert}_key"], password=KEY_PASSWORD if cert == "client" else None
        )
    return ctx


async def test_a_token_guards_every_route(pki):
    sec = HttpSecurity.from_files(token_file=pki["token"])
    assert sec is not None and sec.scheme == "http"
    runner, port = await started(make_app(applier("w"), lambda: True, security=sec), sec)
    try:
        async with aiohttp.ClientSession() as s:
            base = f"http://127.0.0.1:{port}"
            for method, path, body in (
                ("POST", "/v1/score", PROMPT),
                ("POST", "/query", {**PROMPT, "model_name": "m"}),
                ("GET", "/healthz", None),
                ("GET", "/metrics", None),
                ("GET", "/openapi.json", None),
            ):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"}):
                    async with s.request(method, base + path, json=body, headers=headers) as r:
                        assert r.status == 401, (path, headers)
                        assert r.headers["WWW-Authenticate"].startswith("Bearer")
                async with s.request(method, base + path, json=body, headers=sec.peer_headers()) as r:
                    assert r.status == 200, path
            async with s.post(base + "/v1/score", json=PROMPT, headers=sec.peer_headers()) as r:
                assert [x["instance_id"] for x in (await r.json())["scores"]] == ["w"]
    finally:
        await runner.cleanup()


async def test_tls_and_client_certificates(pki):
    sec = HttpSecurity.from_files(cert=pki["server"], client_ca=pki["client_ca"])
    assert sec is not None and sec.scheme == "https"
    runner, port = await started(make_app(applier("w"), lambda: True, security=sec), sec)
    url = f"https://127.0.0.1:{port}/v1/score"
    try:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientError):  # plain HTTP to a TLS port
                async with s.post(f"http://127.0.0.1:{port}/v1/score", json=PROMPT) as r:
                    await r.read()
            for cert in (None, "rogue"):  # no certificate, or one an unknown CA signed
                with pytest.raises((aiohttp.ClientError, ssl.SSLError)):
                    async with s.post(url, json=PROMPT, ssl=client_tls(pki, cert)) as r:
                        await r.read()
            async with s.post(url, json=PROMPT, ssl=client_tls(pki, "client")) as r:
                assert r.status == 200 and (await r.json())["scores"][0]["instance_id"] == "w"
    finally:
        await runner.cleanup()


async def test_peers_scatter_through_tls_and_token(pki, tmp_path):
    """A group secured with one CA and one token: the member a request reaches asks its peer with
    the token and a client certificate, and merges the peer's worker into its answer."""
    # Each member presents a certificate the client CA trusts as its server certificate and as its
    # peer-client identity: here the server's self-signed one, trusted as the CA of both roles.
    sec = HttpSecurity.from_files(cert=pki["server"], client_ca=pki["server_ca"], token_file=pki["token"])
    assert sec is not None
    peer_runner, peer_port = await started(make_app(applier("far"), lambda: True, security=sec), sec)
    peer = f"https://localhost:{peer_port}"
    runner, port = await started(make_app(applier("near"), lambda: True, peers=[peer], security=sec), sec)
    try:
        ctx = ssl.create_default_context(cafile=pki["server_ca"])
        ctx.load_cert_chain(pki["server"])
        async with (
            aiohttp.ClientSession(headers=sec.peer_headers()) as s,
            s.post(f"https://localhost:{port}/v1/score", json=PROMPT, ssl=ctx) as r,
        ):
            body = await r.json()
        assert body["partial"] is False, body
        assert sorted(x["instance_id"] for x in body["scores"]) == ["far", "near"]
    finally:
        await runner.cleanup()
        await peer_runner.cleanup()


def test_unusable_settings_are_refused_before_listening(pki, tmp_path):
    assert HttpSecurity.from_files() is None
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for kwargs, words in (
        ({"token_file": str(empty)}, "empty"),
        ({"token_file": str(tmp_path / "missing")}, "cannot read"),
        ({"key": pki["client_key"]}, "--tls-cert"),
        ({"client_ca": pki["client_ca"]}, "--tls-cert"),
        ({"cert": str(tmp_path / "missing.pem")}, "missing.pem"),
    ):
        with pytest.raises(SecurityConfigError, match=words):
            HttpSecurity.from_files(**kwargs)
