"""Who may talk to an index member's HTTP API: TLS, client certificates, a bearer token.

All optional and independent, as operators combine them: TLS alone (encrypted, anyone may ask),
TLS with ``client_ca`` (only holders of a certificate that CA signed get a connection), a token
(every request carries ``Authorization: Bearer <token>``, else 401), or both. Every route is
guarded, ``/healthz`` and ``/metrics`` included: an orchestrator's probe and Prometheus both send
headers (``httpHeaders``, ``authorization``), and an open route is one an attacker may flood.

Members of one group scatter scores to each other: a member's peer requests carry its own token
and, under mTLS, its own certificate as the client's, trusting ``client_ca`` (or ``peer_ca``) for
the peers' server certificates, so one CA and one token secure a whole group.

The token is read from a file (``--http-token-file``), never from the command line, where every
local user could read it in the process list. It is compared in constant time.
"""

from __future__ import annotations

import hmac
import ssl
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware


class SecurityConfigError(ValueError):
    """An unusable TLS or token setting, named with the file it came from."""


@dataclass(frozen=True)
class HttpSecurity:
    cert: str | None = None  # PEM certificate chain (may hold the key too)
    key: str | None = None  # PEM private key, when not in ``cert``
    client_ca: str | None = None  # require client certificates signed by this CA
    token: str | None = None
    peer_ca: str | None = None  # what peers' server certificates are checked against

    @classmethod
    def from_files(
        cls,
        cert: str | None = None,
        key: str | None = None,
        client_ca: str | None = None,
        token_file: str | None = None,
        peer_ca: str | None = None,
    ) -> HttpSecurity | None:
        """From the CLI's options; None when nothing is asked for. Checked at once, so a member
        with a broken setting exits before it listens rather than serving unprotected."""
        if key and not cert:
            raise SecurityConfigError("--tls-key needs --tls-cert")
        if client_ca and not cert:
            raise SecurityConfigError("--tls-client-ca needs --tls-cert: client certificates are checked in TLS")
        token = None
        if token_file:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as e:
                raise SecurityConfigError(f"cannot read the token file {token_file}: {e.strerror}") from None
            if not token:
                raise SecurityConfigError(f"the token file {token_file} is empty")
        if not (cert or token):
            return None
        out = cls(cert, key, client_ca, token, peer_ca)
        out.server_context()  # fails here, with the file named, if a file is unusable
        return out

    @property
    def scheme(self) -> str:
        return "https" if self.cert else "http"

    def server_context(self) -> ssl.SSLContext | None:
        if not self.cert:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.cert, self.key)
            if self.client_ca:
                ctx.load_verify_locations(self.client_ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as e:
            raise SecurityConfigError(
                f"TLS files {self.cert}, {self.key or '-'}, {self.client_ca or '-'}: {e}"
            ) from None
        return ctx

    def peer_context(self) -> ssl.SSLContext | None:
        """The client side of a scatter to peers: their certificates checked, ours presented."""
        if not self.cert:
            return None
        ctx = ssl.create_default_context(cafile=self.peer_ca or self.client_ca)
        if self.client_ca:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def peer_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def authorized(self, authorization: bytes | None) -> bool:
        """Whether a request with this ``Authorization`` header (None: without one) is let in."""
        if not self.token:
            return True
        return hmac.compare_digest(authorization or b"", f"Bearer {self.token}".encode())

    def middleware(self) -> Middleware:
        @web.middleware
        async def bearer(request: web.Request, handler: Handler) -> web.StreamResponse:
            if self.token:
                got = request.headers.get("Authorization", "").encode()
                if not self.authorized(got):
                    return web.json_response(
                        {"error": "missing or wrong bearer token"},
                        status=401,
                        headers={"WWW-Authenticate": 'Bearer realm="kvwire"'},
                    )
            return await handler(request)

        return bearer
