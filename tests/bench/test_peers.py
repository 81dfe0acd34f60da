"""The peers step's Python side: the dump replays exactly the bench's workload, kvwire's answers
are right, a disagreement fails the run, and the summary / README carry its keys. The Rust
harness (Dynamo's trees) is never built here: CI does not compile dynamo-kv-router."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from bench import report, run
from bench.index_memory import BS, N_WORKERS, Workload, build
from bench.peers import SUMMARY_KEYS, dump, kvwire_side
from bench.peers import __main__ as peers
from bench.score_latency import queries

HB, NQ = 30_000, 12


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, dump.Header]:
    path = tmp_path_factory.mktemp("peers") / "w.dump"
    return path, dump.write(path, HB, NQ)


def test_dump_is_the_bench_workload(small) -> None:
    path, h = small
    # build()'s own stopping rule gives the same holder-blocks, which kvwire's side checks again
    ix, applied, _ = build(HB, Workload())
    assert h.holder_blocks == len(ix) and h.blocks_stored == applied
    assert (h.block_size, h.workers, h.query_tokens, h.queries) == (BS, N_WORKERS, 8192, NQ)
    # the events rebuilt from the file equal Workload.conversation's, in build's order
    wl = Workload()
    d = dump.Dump(path)
    convs = list(d.conversations())
    assert len(convs) == h.conversations
    for i, (w, hashes, tokens) in enumerate(convs):
        assert w == i % N_WORKERS
        assert kvwire_side.events(h, hashes, tokens) == wl.conversation(w, i // N_WORKERS)
    # and the queries are score_latency's, drawn from the workload after those conversations
    for got, want in zip(d.queries(), queries(wl, 8192, NQ), strict=True):
        np.testing.assert_array_equal(got, want)
    d.close()


def _oracle(path: Path) -> list[list[tuple[int, int]]]:
    """Per query, each worker's longest run of full blocks equal to the start of a conversation it
    stored: brute force over the dumped tokens, no index, no hashing."""
    d = dump.Dump(path)
    bs = d.header.block_size
    held: dict[int, list[np.ndarray]] = {}
    for w, _, tokens in d.conversations():
        held.setdefault(w, []).append(tokens.reshape(-1, bs))
    out = []
    for q in d.queries():
        qb = q.reshape(-1, bs)
        row = []
        for w, convs in held.items():
            best = 0
            for c in convs:
                n = min(len(c), len(qb))
                same = np.all(c[:n] == qb[:n], axis=1)
                best = max(best, n if same.all() else int(np.argmin(same)))
            if best:
                row.append((w, best))
        out.append(sorted(row))
    d.close()
    return out


def test_kvwire_side_answers_equal_brute_force(small, tmp_path: Path) -> None:
    path, h = small
    raw = kvwire_side.run(path, tmp_path / "a")
    got = dump.read_answers(tmp_path / "a", h.queries)
    want = _oracle(path)
    assert got == want
    assert any(len(a) > 1 for a in want) and any(b == 512 for a in want for _, b in a)  # not trivial
    assert raw["tree_holder_blocks"] == h.holder_blocks and raw["blocks_applied"] == h.blocks_stored
    assert len(raw["score_cpu_us"]) == len(raw["score_wall_us"]) == h.queries
    f = peers.figures(raw)
    assert f["apply_blocks_per_s"] > 0 and f["score_cpu_us"]["p99"] >= f["score_cpu_us"]["p50"]


def test_answers_round_trip_and_a_mismatch_fails(tmp_path: Path) -> None:
    ans = [[(3, 64), (1, 512)], [], [(0, 7)]]
    dump.write_answers(tmp_path / "x", ans)
    back = dump.read_answers(tmp_path / "x", 3)
    assert back == [sorted(a) for a in ans]
    peers.check_answers(back, copy.deepcopy(back), "radix")
    other = copy.deepcopy(back)
    other[2] = [(0, 6)]
    with pytest.raises(peers.PeersError, match=r"ANSWERS DIFFER: crtc query 2"):
        peers.check_answers(back, other, "crtc")
    with pytest.raises(ValueError):
        dump.read_answers(tmp_path / "x", 2)  # trailing bytes: a count mismatch is not ignored


def test_no_cargo_is_a_clear_error(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(peers.shutil, "which", lambda _: None)
    monkeypatch.setattr(peers.Path, "home", lambda: tmp_path)
    with pytest.raises(peers.PeersError, match="cargo not found"):
        peers.harness()


def test_a_failed_build_is_a_clear_error(monkeypatch, tmp_path: Path) -> None:
    # A cargo that fails as a broken build does (compile error, offline registry): the step says so.
    cargo = tmp_path / "cargo"
    cargo.write_text("#!/bin/sh\necho 'error: failed to download dynamo-kv-router' >&2\nexit 101\n")
    cargo.chmod(0o755)
    monkeypatch.setattr(peers.shutil, "which", lambda _: str(cargo))
    with pytest.raises(peers.PeersError, match=r"cargo build of bench/peers failed \(exit 101\): error: failed to"):
        peers.harness()


def _raw(apply_cpu_s: float, score_us: float, rss: int) -> dict:
    return {
        "holder_blocks": 1000,
        "blocks_applied": 1000,
        "apply_cpu_s": apply_cpu_s,
        "apply_wall_s": apply_cpu_s * 1.1,
        "publisher_hashing_cpu_s": 0.0,
        "rss_anon_growth_bytes": rss,
        "score_cpu_us": [score_us] * 50 + [score_us * 4] * 2,
        "score_wall_us": [score_us] * 52,
    }


def _peers_result() -> dict:
    rounds = []
    for r in range(3):
        row = {
            "kvwire": peers.figures(_raw(0.01, 20.0 + r, 40_000)),
            "radix": peers.figures(_raw(0.002, 10.0, 66_000)),
            "crtc": peers.figures(_raw(0.0025, 8.0, 66_000)),
        }
        row["ratios_vs"] = {d: peers.ratios(row["kvwire"], row[d]) for d in ("radix", "crtc")}
        rounds.append(row)
    res = {
        "params": {
            "holder_blocks": 1000,
            "workers": 256,
            "query_tokens": 8192,
            "rounds": 3,
            "dynamo_kv_router": peers.DYNAMO,
        },
        "answers_equal": True,
        "load_avg": {"start": [1.5, 1.0, 0.5], "end": [2.5, 1.0, 0.5]},
        "rounds": rounds,
    }
    res.update(peers.aggregate(rounds))
    return json.loads(json.dumps(res))  # as read back from peers.json


def test_summary_and_readme_carry_the_peers_keys() -> None:
    res = _peers_result()
    # per-round ratios, then their median: kvwire p50 21 µs over radix 10 µs, apply 100k vs 500k blocks/s
    assert res["peers_score_p50_ratio_vs_dynamo_radix"] == 2.1
    assert res["peers_apply_ratio_vs_dynamo_radix"] == 0.2
    assert res["peers_apply_ratio_vs_dynamo_crtc"] == 0.25
    s = run.summarize({"peers": res}, {})
    assert tuple(s) == run.SUMMARY_KEYS and set(SUMMARY_KEYS) <= set(s)
    assert {k: s[k] for k in SUMMARY_KEYS} == {k: res[k] for k in SUMMARY_KEYS}
    assert "every answer equal" in s["notes"]["peers"]
    figures = dict(report.load(), peers=res)
    table = report.results_table(figures)
    assert "| 100,000 | 500,000 / 400,000 " in table  # apply: kvwire, then RadixTree / CRTC
    assert "RadixTree 2.1x / 2.1x / 0.2x; CRTC 2.62x / 2.62x / 0.25x" in table
    assert "1,000 holder-blocks" in table
    # without a peers run the keys are null with the step's error, and the table says so
    s = run.summarize({}, {"peers": "exit 1: peers: cargo not found"})
    assert all(s[k] is None and "cargo not found" in s["notes"][k] for k in SUMMARY_KEYS)
    assert "not measured yet" in report.results_table(dict(figures, peers={}))


def test_peers_is_a_step_of_full_and_quick_runs_only() -> None:
    def peers_args(mode: str, size: int | None = None) -> list[str] | None:
        return next((a for n, a, _ in run.steps(mode, "b:1", size) if n == "peers"), None)

    assert peers_args("full") == ["-m", "bench.peers"]  # 10M holder-blocks
    assert peers_args("quick") == ["-m", "bench.peers", "--quick"]  # 1M
    assert peers_args("full", 2_000_000) == ["-m", "bench.peers", "--holder-blocks", "2000000"]
    assert peers_args("smoke") is None
