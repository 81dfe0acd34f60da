"""CI's compose check, from the host: a worker publishes blocks through the compose broker's
published port, then the compose `index` answers /healthz 200 and /v1/score reports exactly
those blocks for that worker.

usage: python .ci/compose_check.py KAFKA_BOOTSTRAP INDEX_URL
Exit 0 when the index serves a worker's published blocks, 1 (with the reason) otherwise."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request

from kvwire.producer.publisher import KafkaPublisher, PublisherConfig
from kvwire.schemas.events import WorkerId, stored

TOPIC = "kvwire.events"  # the topic docker-compose.yml's index reads
BLOCK = 16


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, json.loads(r.read())


def wait(what: str, probe, timeout_s: float):
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            ok, last = probe()
            if ok:
                return last
        except (OSError, ValueError) as e:
            last = repr(e)
        time.sleep(1)
    raise SystemExit(f"compose check: {what} not seen in {timeout_s:.0f}s; last answer: {last}")


def main(bootstrap: str, index_url: str) -> None:
    # One worker stores 5 full blocks of a prompt; a query of that prompt plus a tail it never
    # stored must match exactly those 5 blocks, for that worker alone.
    tokens = [(31 * i + 7) % 50_000 for i in range(5 * BLOCK)]
    worker = WorkerId(f"ci-compose-{int(time.time())}", 0, 0, 1)
    pub = KafkaPublisher(PublisherConfig(bootstrap_servers=bootstrap, topic=TOPIC, partitions=1, linger_ms=1))
    stream = pub.stream(worker, "ci")
    assert stream.publish([stored([1000 + i for i in range(5)], tokens, BLOCK)])
    pub.close(60)
    stats = pub.stats()
    if sum(s.acked for s in stats) < 1:
        raise SystemExit(f"compose check: the broker at {bootstrap} did not acknowledge the record: {stats}")

    # The index is ready once it owns the topic's partitions and has caught up, so only after a
    # producer made the topic: /healthz is checked after publishing.
    t0 = time.monotonic()
    health = wait("index /healthz 200", lambda: (lambda s, b: (s == 200, (s, b)))(*get(f"{index_url}/healthz")), 240)
    print(f"compose check: /healthz {health} {time.monotonic() - t0:.1f}s after publishing", file=sys.stderr)

    query = {"token_ids": [*tokens, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], "block_size": BLOCK}

    def scored():
        status, body = post(f"{index_url}/v1/score", query)
        mine = [s for s in body.get("scores", []) if s["instance_id"] == worker.instance_id]
        return status == 200 and bool(mine) and mine[0]["matched_tokens"] == len(tokens), (status, body)

    status, body = wait(f"/v1/score matching {len(tokens)} tokens for {worker.instance_id}", scored, 120)
    print(f"compose check: /v1/score {status} {json.dumps(body)[:300]}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2].rstrip("/"))
