"""docs/scale.md is generated from bench/results/*.json by bench/scale.py: a hand edit, or a results
file that changed without regenerating, fails here; and each per-unit cost moves the figures that
depend on it, and only those."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest

from bench import report, scale


@pytest.fixture
def results() -> dict[str, Any]:
    return report.load()


def _fleets(res: dict[str, Any]) -> dict[int, dict[str, Any]]:
    c = scale.costs(res)
    pts = scale.latency_points(scale._http_run(res, 1))
    return {w: scale.fleet(w, c, pts) for w in scale.SIZES}


def test_doc_is_what_the_generator_writes(results) -> None:
    assert scale.DOC.read_text() == scale.render(results), "regenerate with `python -m bench.scale`"


def test_every_results_file_the_doc_reads_is_there(results) -> None:
    for name in ("index_memory", "apply_rate", "http_score", "kafka_side", "peers", "replay", "lag"):
        assert name in results, name
    # No saturation is a result, not a moved key: then the doc names the top level instead.
    unsaturated = (
        "saturated_at_offered_blocks_per_s" in results["lag"]
        and not results["lag"]["saturated_at_offered_blocks_per_s"]
    )
    optional = ("ask_", "remove", *(("lag_saturation",) if unsaturated else ()))
    assert all(c.value is not None for k, c in scale.costs(results).items() if not k.startswith(optional)), (
        "a per-unit cost reads n/a: its results key moved"
    )


def test_apply_rate_sets_members_not_memory_or_groups(results) -> None:
    before = _fleets(results)
    faster = copy.deepcopy(results)
    faster["apply_rate"]["apply_blocks_per_s"] *= 4
    after = _fleets(faster)
    big = max(scale.SIZES)
    assert after[big]["m_apply"] < before[big]["m_apply"]
    assert after[big]["members"] < before[big]["members"]
    assert after[big]["member_bytes"] > before[big]["member_bytes"]  # fewer members, each holds more
    assert after[big]["index_bytes"] == before[big]["index_bytes"]
    assert after[big]["full_apply_share"] == pytest.approx(before[big]["full_apply_share"] / 4)
    assert scale.render(faster) != scale.render(results)


def test_bytes_per_holder_block_sets_memory(results) -> None:
    before = _fleets(results)
    fat = copy.deepcopy(results)
    fat["peers"]["median"]["kvwire"]["rss_bytes_per_holder_block"] *= 100
    after = _fleets(fat)
    for w in scale.SIZES:
        assert after[w]["index_bytes"] == pytest.approx(before[w]["index_bytes"] * 100)
        assert after[w]["m_mem"] > before[w]["m_mem"]
        assert after[w]["m_apply"] == before[w]["m_apply"]


def test_score_cost_sets_groups_not_members(results) -> None:
    before = _fleets(results)
    slow = copy.deepcopy(results)
    for member in slow["http_score"]["members"]:
        for run in member["runs"]:
            run["member_cpu_us_per_request"] *= 3
    after = _fleets(slow)
    big = max(scale.SIZES)
    assert after[big]["groups"] > before[big]["groups"]
    assert after[big]["members"] == before[big]["members"]
    assert after[big]["group_cpu_us"] > before[big]["group_cpu_us"]


def test_record_bytes_set_broker_load(results) -> None:
    before = _fleets(results)
    wide = copy.deepcopy(results)
    wide["kafka_side"]["coalesce"]["1"]["value_bytes_per_block"] *= 2
    after = _fleets(wide)
    for w in scale.SIZES:
        assert after[w]["produce_bytes"] > before[w]["produce_bytes"]
        assert after[w]["broker_out"] > before[w]["broker_out"]
        assert after[w]["records"] == before[w]["records"]


def test_assumptions_drive_the_fleet(results, monkeypatch) -> None:
    before = _fleets(results)
    monkeypatch.setitem(
        scale.ASSUMPTIONS, "requests_per_worker_s", scale.Assumption(2.0, "requests per worker per second", "test")
    )
    after = _fleets(results)
    for w in scale.SIZES:
        assert after[w]["churn"] == pytest.approx(2 * before[w]["churn"])
        assert after[w]["queries"] == pytest.approx(2 * before[w]["queries"])
        assert after[w]["holder_blocks"] == before[w]["holder_blocks"]


def test_without_the_scatter_measurement_the_doc_says_so(results) -> None:
    bare = {k: v for k, v in results.items() if k != "scale"}
    text = scale.render(bare)
    assert "Not measured: `bench/results/scale.json` is absent" in text
    assert "a removal taken as large as a store (not measured)" in text


def test_tail_of_the_fan_out() -> None:
    pts = [(0.5, 100.0), (0.9, 200.0), (0.99, 400.0), (0.999, 800.0)]
    assert scale.p99_of_max(pts, 1) == pytest.approx(400.0)
    tails = [scale.p99_of_max(pts, n) for n in (1, 2, 5, 10)]
    assert all(a is not None and b is not None and a < b for a, b in itertools.pairwise(tails))
    assert scale.p99_of_max(pts, 10) == pytest.approx(800.0, rel=0.01)  # 0.99^(1/10) ≈ 0.999
    assert scale.p99_of_max(pts, 100) is None  # past the sample: no guess
    assert scale.scatter_p99(pts, 0, 50.0) == pytest.approx(400.0)
    one = scale.scatter_p99(pts, 1, 50.0)
    assert one == pytest.approx(100.0 + 400.0 + 50.0)


def test_hashed_partitions_match_kvwires_partitioner() -> None:
    from kvwire.producer.partitioner import default_partition

    top, ratio, empty = scale.hashed_spread(100, 12)
    counts = [0] * 12
    for i in range(100):
        counts[default_partition(f"worker-{i}/0".encode(), 12)] += 1
    assert (top, empty) == (max(counts), counts.count(0))
    assert ratio == pytest.approx(max(counts) / (100 / 12))
