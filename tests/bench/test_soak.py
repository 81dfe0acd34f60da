"""The soak step (bench/soak.py) on a few seconds of churn: what its simulated pools hold is what
the wire says they hold and what the index counts, full pools plateau at their configured size,
and the growth figure is the one its series gives. No timed assertions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from bench import report, run, soak
from kvwire.schemas import codec
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored

ROOT = Path(__file__).resolve().parents[2]
WORKERS, HOLDER_BLOCKS, DURATION, CLEAR_EVERY = 8, 16_384, 3.0, 1.0


class Replay:
    """The brute-force oracle: every record's bytes decoded by the reference decoder (fastavro),
    and per worker the set of engine hashes its stores and removes leave it holding."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = defaultdict(set)
        self.cleared: set[str] = set()
        self.bad: list[str] = []  # a store of a held block or a remove of one not held

    def __call__(self, value: bytes) -> None:
        b = codec.decode(value)
        h = self.held[b.worker.instance_id]
        for e in b.events:
            if isinstance(e, BlockStored):
                if e.parent_block_hash is not None and e.parent_block_hash not in h:
                    self.bad.append(f"{b.worker.instance_id}: store under a parent not held")
                for x in e.block_hashes:
                    if x in h:
                        self.bad.append(f"{b.worker.instance_id}: {x} stored twice")
                    h.add(x)
            elif isinstance(e, BlockRemoved):
                for x in e.block_hashes:
                    if x not in h:
                        self.bad.append(f"{b.worker.instance_id}: {x} removed but not held")
                    h.discard(x)
            elif isinstance(e, AllBlocksCleared):
                h.clear()
                self.cleared.add(b.worker.instance_id)


@pytest.fixture(scope="module")
def smoke() -> tuple[soak.Soak, dict, Replay]:
    oracle = Replay()
    s = soak.Soak(
        DURATION, 20_000, WORKERS, HOLDER_BLOCKS, qps=50, clear_every_s=CLEAR_EVERY, sample_s=0.1, on_record=oracle
    )
    return s, s.run(), oracle


def test_pools_plateau_at_their_size_and_the_index_counts_what_they_hold(smoke) -> None:
    s, res, oracle = smoke
    cap = HOLDER_BLOCKS // WORKERS
    assert not oracle.bad, oracle.bad[:5]
    assert res["pools_full_s"] is not None and res["dead_letters"] == 0
    # one clear per CLEAR_EVERY seconds, of workers 0, 1, ... in turn; the others ended full
    assert res["clears"] == len(oracle.cleared) == int(DURATION / CLEAR_EVERY - 1e-9)
    stats = s.index.workers()
    for e in s.fleet.engines:
        name = e.rank.instance_id
        want = len(oracle.held[name])
        assert e.pool.size == want <= cap, name
        st = stats[(name, 0)]
        assert st.blocks == {"GPU": want}, name
        assert (st.orphans, st.unknown_removes, st.duplicate_stores) == (0, 0, 0), name
        if name not in oracle.cleared:
            assert want == cap, name
    assert len(s.index) == sum(len(h) for h in oracle.held.values()) == res["holder_blocks_end"]
    assert res["pool_blocks_end"] == res["holder_blocks_end"]
    # the series never holds more than the pools' size, and every sample agrees with the pools
    assert max(x["holder_blocks"] for x in res["series"]) <= cap * WORKERS == res["params"]["holder_blocks"]
    assert all(x["holder_blocks"] == x["pool_blocks"] for x in res["series"])
    # churn happened: the pools evicted, and the removes reached the index
    assert res["removed_blocks"] > 0 and res["stored_blocks"] - res["removed_blocks"] >= len(s.index)


def test_series_is_sampled_in_time_order(smoke) -> None:
    _, res, _ = smoke
    ser = res["series"]
    assert len(ser) >= 10
    ts = [x["t_s"] for x in ser]
    assert ts == sorted(ts) and len(set(ts)) == len(ts)
    assert ts[-1] == res["duration_s"] >= DURATION
    assert all(x["rss_anon_bytes"] > 0 and x["vm_rss_bytes"] >= x["rss_anon_bytes"] for x in ser)
    assert all(x["index_nbytes"] > 0 for x in ser[1:])
    stored = [x["stored_blocks"] for x in ser]
    assert stored == sorted(stored)
    assert res["score_queries"] > 0 and res["recent_conversation_hit_share"] > 0


def test_growth_is_computed_from_the_series_as_specified(smoke) -> None:
    _, res, _ = smoke
    ser, end = res["series"], res["duration_s"]
    warm = max(0.2 * end, res["pools_full_s"])
    assert res["warmup_end_s"] == pytest.approx(warm, abs=1e-3)
    for field, key in (("rss_anon_bytes", "soak_rss_growth_pct"), ("index_nbytes", "index_nbytes_growth_pct")):
        base = next(x[field] for x in ser if x["t_s"] >= res["warmup_end_s"])
        top = max(x[field] for x in ser if x["t_s"] >= 0.9 * end)
        assert res[key] == pytest.approx((top - base) / base * 100, abs=1e-3), field
    assert res["holder_blocks_start"] == next(x["holder_blocks"] for x in ser if x["t_s"] >= res["warmup_end_s"])


def test_growth_is_null_without_an_end_of_warm_up() -> None:
    ser = [{"t_s": t, "v": 100 + t} for t in range(11)]
    assert soak.growth(ser, "v", 2.0)["pct"] == pytest.approx((110 - 102) / 102 * 100, abs=1e-3)
    assert soak.growth(ser, "v", None)["pct"] is None
    assert soak.growth(ser, "v", 9.5)["pct"] is None  # warm-up ended inside the last 10%
    assert soak.growth([], "v", 1.0)["pct"] is None


def test_core_option_loads_the_given_copy(tmp_path) -> None:
    # bench.soak imports no core at module level, so --core decides which one the run uses
    probe = "import sys, bench.soak; assert 'kvwire._core' not in sys.modules"
    subprocess.run([sys.executable, "-c", probe], cwd=ROOT, check=True)
    from kvwire import _core

    copy = tmp_path / "core_copy.so"
    shutil.copy(_core.__file__, copy)
    env = dict(os.environ, KVWIRE_BENCH_RESULTS=str(tmp_path), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "bench.soak", "--smoke", "--duration-s", "0.5", "--no-plot", "--core", str(copy)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=120)
    got = json.loads((tmp_path / "soak.json").read_text())
    assert got["params"]["core"] == str(copy) and got["params"]["mode"] == "smoke"
    assert got["stored_blocks"] > 0


def test_bench_runs_the_soak_of_its_mode_and_summarizes_it(smoke) -> None:
    by_mode = {m: {n: a for n, a, _ in run.steps(m, "b:9092")} for m in ("full", "quick", "smoke")}
    assert by_mode["full"]["soak"] == ["-m", "bench.soak"]
    assert by_mode["quick"]["soak"] == ["-m", "bench.soak", "--quick"]
    assert by_mode["smoke"]["soak"] == ["-m", "bench.soak", "--smoke"]
    assert "soak" in run.BROKERLESS
    _, res, _ = smoke
    s = run.summarize({"soak": res}, {})
    assert s["soak_rss_growth_pct"] == res["soak_rss_growth_pct"]
    assert "RssAnon" in s["notes"]["soak_rss_growth_pct"]
    assert "soak_rss_growth_pct" in report.TARGETS
    unmeasured = dict(res, soak_rss_growth_pct=None, growth_note="the pools never filled")
    s = run.summarize({"soak": unmeasured}, {})
    assert s["soak_rss_growth_pct"] is None and s["notes"]["soak_rss_growth_pct"].startswith("null: the pools")
    assert run.summarize({}, {"soak": "timed out"})["notes"]["soak_rss_growth_pct"] == "null: timed out"
    row = next(r for r in report.results_table({"soak": res, "summary": {}}).splitlines() if "Soak" in r)
    assert "dynamo#10774" in row
