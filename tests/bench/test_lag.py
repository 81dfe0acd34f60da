"""The lag step's summary: the median of the target level's rounds, every round named, and
records a publisher dropped never left out of the note (they have no lag sample)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench import run

LAG = json.loads((Path(run.__file__).parent / "results" / "lag.json").read_text())


def test_the_figure_is_the_median_of_the_target_rounds_and_each_is_named():
    rounds = LAG["lag_rounds_at_reported"]
    assert len(rounds) > 1
    assert LAG["lag_p99_ms"] == statistics.median(r["p99"] for r in rounds)
    note = run.summarize({"lag": LAG}, {})["notes"]["lag_p99_ms"]
    assert f"the median of {len(rounds)} rounds' p99" in note
    for r in rounds:
        assert str(r["p99"]) in note


def test_dropped_records_are_named_in_the_note():
    lossy = {**LAG, "dropped_at": [{"offered_blocks_per_s": 537_138, "round": None, "dropped": 14_522}]}
    note = run.summarize({"lag": lossy}, {})["notes"]["lag_p99_ms"]
    assert "14,522 records dropped" in note and "537,138 blocks/s" in note
    assert "dropped" not in run.summarize({"lag": {**LAG, "dropped_at": []}}, {})["notes"]["lag_p99_ms"]
