"""README figures come from bench/results/*.json: a figure that disagrees with its JSON fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

from bench import report


def test_readme_figures_match_their_json() -> None:
    stale = report.stale(report.load())
    assert not stale, f"regenerate with `python -m bench.report`: {stale}"


def test_every_generated_block_is_known_and_present() -> None:
    names = set()
    for p in report.READMES:
        names |= set(re.findall(r"<!-- figures:([a-z_]+) -->", p.read_text()))
    assert names <= set(report.BLOCKS)
    assert {"results", "targets", "codec", "replay", "faults"} <= names
    # and every one is rendered: an unmatched (empty) block would pass the staleness check vacuously
    for p in report.READMES:
        bodies = {m["name"]: m["body"] for m in report._BLOCK.finditer(p.read_text())}
        assert set(bodies) == set(re.findall(r"<!-- figures:([a-z_]+) -->", p.read_text())), p
        assert all(b.strip() for b in bodies.values()), p


def test_blocks_follow_the_json(tmp_path: Path) -> None:
    # A changed measurement changes the rendered README, and a missing one reads n/a, not a stale value.
    figures = report.load()
    figures["summary"] = dict(figures.get("summary", {}), apply_blocks_per_s=1_234_567)
    assert "1,234,567" in report.results_table(figures)
    figures["summary"].pop("bytes_per_holder_block", None)
    assert re.search(r"\| `bytes_per_holder_block` \|[^\n]*\| n/a \| not measured", report.targets_table(figures))
    text = "x\n<!-- figures:results -->\nold 42\n<!-- /figures:results -->\ny"
    assert "old 42" not in report.render_file(text, figures)
    empty = "x\n<!-- figures:results -->\n<!-- /figures:results -->\ny"
    assert "1,234,567" in report.render_file(empty, figures)
    (tmp_path / "summary.json").write_text(json.dumps({"apply_blocks_per_s": 7}))
    assert report.load(tmp_path)["summary"]["apply_blocks_per_s"] == 7
