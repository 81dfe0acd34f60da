"""`kvwire index` refuses a setting that can never work before it reaches for anything: exit 2,
the option named, and nothing served unprotected (a token file it cannot read is not ignored)."""

from __future__ import annotations

import pytest
from test_unreachable import _closed, kvwire


@pytest.mark.parametrize(
    ("args", "named", "why"),
    [
        (["--event-streams", "nope"], "--event-streams", "[HOST:]PORT"),
        (["--event-streams", "127.0.0.1:70000"], "--event-streams", "[HOST:]PORT"),
        (["--http-token-file", "/nonexistent/token"], "--http-token-file", "cannot read the token file"),
        (["--tls-key", "/nonexistent/key.pem"], "--tls-", "--tls-key needs --tls-cert"),
        (["--tls-cert", "/nonexistent/cert.pem"], "--tls-", "/nonexistent/cert.pem"),
    ],
)
def test_an_unusable_setting_is_refused_at_once(args, named, why):
    r = kvwire("index", "-b", _closed(), "--http", "127.0.0.1:0", *args)
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out
    assert named in out and why in out and "Traceback" not in out, out
