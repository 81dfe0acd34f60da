"""Peers in the bench: Dynamo's radix trees beside kvwire's core, on kvwire's own workload.

``python -m bench.peers`` (the ``peers`` step of ``kvwire bench``) dumps the workload once
(``dump.py``), builds the Rust harness here (``Cargo.toml``, ``src/main.rs``: Dynamo's
``RadixTree`` and ``ConcurrentRadixTreeCompressed`` from ``dynamo-kv-router``), then replays the
dump in one process per index per round, alternating sides (``__main__.py``). kvwire's side is
``kvwire_side.py``: its core through Python, the path users get.
"""

# summary.json keys (kvwire / Dynamo, medians of per-round ratios), in summary order.
SUMMARY_KEYS = tuple(
    f"peers_{m}_ratio_vs_dynamo_{d}" for d in ("radix", "crtc") for m in ("score_p99", "score_p50", "apply")
)
