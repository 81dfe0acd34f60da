"""AllBlocksCleared of one rank holding 1M blocks: how long the apply that carries it takes, and
what the deferred purge of its slots costs the applies after it.

    python -m bench.clear_rank                    # 1M blocks cleared, 4M held by 255 others
    python -m bench.clear_rank --quick            # 200k cleared, 800k others
    python -m bench.clear_rank --smoke            # 8k cleared, 32k others (the harness's smoke run)
    python -m bench.clear_rank --core OLD.so      # the same against another build of the core

The core retires a cleared table's rm id at once (nothing reads its slots again) and purges the
slots from S in bounded sweeps at the start of later applies. So the figures are the clear's own
apply (``clear_rank_ms_1m_blocks``, on-CPU and wall, median of the rounds), the slowest apply
while the sweep runs, and how many applies the sweep took. Each round checks the answers: the
cleared worker is credited nothing right after the clear, and again everything once it has
stored its blocks anew. Writes ``bench/results/clear_rank.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import TYPE_CHECKING

from .common import write_result

if TYPE_CHECKING:
    from kvwire.consumer.index import PrefixIndex

    from .index_memory import Workload


def _store(ix: PrefixIndex, wl: Workload, w: int, blocks: int) -> list:
    """Worker w stores `blocks` blocks of new conversations; returns their events."""
    from .index_memory import CONV_BLOCKS

    convs = [wl.conversation(w, c) for c in range(blocks // CONV_BLOCKS)]
    _apply(ix, wl, w, convs)
    return convs


def _apply(ix: PrefixIndex, wl: Workload, w: int, convs: list) -> None:
    for evs in convs:
        for i in range(0, len(evs), 2):  # two events per record, as the publisher batches them
            ix.apply_batch(wl.workers[w], evs[i : i + 2])


def _tokens(evs) -> list[int]:
    return [t for e in evs for t in e.token_ids]


def _credit(ix: PrefixIndex, tokens: list[int], name: tuple[str, int]) -> int:
    return next((s.matched_tokens for s in ix.score(tokens) if (s.instance_id, s.dp_rank) == name), 0)


def run(cleared: int, others: int, rounds: int) -> dict:
    # Imported here, after --core has installed the build under test.
    from kvwire.consumer.index import PrefixIndex
    from kvwire.schemas.events import AllBlocksCleared

    from .index_memory import N_WORKERS, Workload

    wl = Workload()
    ix = PrefixIndex()
    per_other = others // (N_WORKERS - 1)
    for w in range(1, N_WORKERS):
        _store(ix, wl, w, per_other)
    target = wl.workers[0]
    convs = _store(ix, wl, 0, cleared)
    probe = _tokens(convs[0])
    name = (target.instance_id, target.dp_rank)
    full = _credit(ix, probe, name)
    other = wl.workers[1]
    rows = []
    for r in range(rounds):
        held = len(ix)
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        ix.apply_batch(target, [AllBlocksCleared()])
        cpu_ms, wall_ms = (time.thread_time_ns() - c0) / 1e6, (time.perf_counter_ns() - t0) / 1e6
        credited_after_clear = _credit(ix, probe, name)
        # The applies after the clear: other workers' records, until the purge is done.
        pauses = []
        applies = 0
        c = 10_000 + r * 1000
        unswept = ix.unswept if hasattr(ix.core, "unswept") else (lambda: (0, 0))  # older builds clear at once
        while True:
            evs = wl.conversation(1, c)
            for i in range(0, len(evs), 2):
                if unswept()[0] == 0:
                    break
                a0 = time.thread_time_ns()
                ix.apply_batch(other, evs[i : i + 2])
                pauses.append((time.thread_time_ns() - a0) / 1e6)
                applies += 1
            else:
                c += 1
                continue
            break
        _apply(ix, wl, 0, convs)
        # The same conversations stored again: the worker is credited in full.
        credited_again = _credit(ix, probe, name)
        rows.append(
            {
                "held_before": held,
                "clear_cpu_ms": round(cpu_ms, 3),
                "clear_wall_ms": round(wall_ms, 3),
                "credited_after_clear": credited_after_clear,
                "credited_after_restore": credited_again,
                "sweep_applies": applies,
                "sweep_max_apply_ms": round(max(pauses), 3) if pauses else None,
                "sweep_total_cpu_ms": round(sum(pauses), 3),
            }
        )
    return {
        "cleared_rank_blocks": cleared,
        "other_blocks": per_other * (N_WORKERS - 1),
        "workers": N_WORKERS,
        "rounds": rows,
        "clear_rank_ms_1m_blocks": statistics.median(r["clear_cpu_ms"] for r in rows) * 1_000_000 / cleared,
        "clear_wall_ms_median": statistics.median(r["clear_wall_ms"] for r in rows),
        "answers_ok": all(r["credited_after_clear"] == 0 and r["credited_after_restore"] == full for r in rows)
        and full == len(probe),
        "load_avg": list(os.getloadavg()),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--core", help="load kvwire._core from this file (a copy of another build)")
    p.add_argument("--no-write", action="store_true", help="print only (A/B runs of other builds)")
    a = p.parse_args(argv)
    if a.core:
        from .ab_core import _load_core

        _load_core(a.core)
    cleared, others = (8_192, 32_640) if a.smoke else (200_192, 800_000) if a.quick else (1_000_448, 4_000_000)
    res = run(cleared, others, a.rounds)
    for r in res["rounds"]:
        print(r)
    print(
        f"clear_rank_ms_1m_blocks {res['clear_rank_ms_1m_blocks']:.3f} (on-CPU, scaled to 1M from"
        f" {cleared:,}); answers ok: {res['answers_ok']}"
    )
    if not a.no_write:
        write_result("clear_rank", res)


if __name__ == "__main__":
    main()
