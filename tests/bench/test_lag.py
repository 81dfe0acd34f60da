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


def test_a_level_is_saturated_by_the_part_that_could_not_keep_up():
    from bench.lag import _saturated_by

    # 1,000 publish() calls asked for; the member's share of what was published is `applied`.
    assert _saturated_by(1_000, 0, 1.0, 0.99) is None
    assert _saturated_by(1_000, 0, 1.0, 0.90) == "member"
    # A hand-off full for more than 5% of the calls: the sender thread fell behind.
    assert _saturated_by(900, 100, 1.0, 1.0) == "publisher sender (hand-off full)"
    assert _saturated_by(960, 40, 1.0, 1.0) is None  # a stall's drops, not a sustained loss
    # The publisher process could not even make the calls at the level's pace.
    assert _saturated_by(1_000, 0, 0.87, 1.0) == "publisher process (publish() calls behind their pace)"
    # The member is named first: a backlog there is what the lag measures.
    assert _saturated_by(900, 100, 0.5, 0.5) == "member"
    assert _saturated_by(0, 0, 1.0, None) is None


def test_the_note_names_where_the_pipeline_saturated():
    sat = {**LAG, "saturated_at_offered_blocks_per_s": 555_183, "saturated_at_target_blocks_per_s": 640_000}
    sat["saturated_by"] = "publisher process (publish() calls behind their pace)"
    note = run.summarize({"lag": sat}, {})["notes"]["lag_p99_ms"]
    assert "saturated at 555,183 blocks/s offered (640,000 asked), by the publisher process" in note
    unsat = {**LAG, "saturated_at_offered_blocks_per_s": None, "saturated_by": None}
    assert "no level saturated" in run.summarize({"lag": unsat}, {})["notes"]["lag_p99_ms"]
