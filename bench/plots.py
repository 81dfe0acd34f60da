"""PNG plots of the benchmark results (matplotlib, Agg backend). Each plot is drawn only when
its JSON is present, so a partial run still gets the plots it can.

    python -m bench.plots [RESULTS_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SMG_BYTES_PER_HOLDER_BLOCK = 26.9  # SGLang SMG, published (theirs)
SMG_SCORE_P50_US, SMG_SCORE_P99_US = 0.292, 7.6  # SGLang SMG, hashing excluded (theirs)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _load(d: Path, name: str):
    p = d / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _save(fig, d: Path, name: str) -> Path:
    p = d / f"{name}.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    return p


def plot_lag(d: Path, r: dict):
    plt = _plt()
    rows = [x for x in r["levels"] if x["lag_ms"]["p50"] is not None and (x.get("round") or 1) == 1]
    x = [x["offered_blocks_per_s"] for x in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for p, st in (("p50", "o-"), ("p99", "s-"), ("p99.9", "^--")):
        ax.plot(x, [x_["lag_ms"][p] for x_ in rows], st, label=f"lag {p}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered load, blocks/s (16 blocks per record)")
    ax.set_ylabel("publish() -> applied, ms")
    ax2 = ax.twinx()
    ax2.plot(x, [x_["applied_over_offered"] for x_ in rows], "k:", label="applied / offered")
    ax2.axhline(0.95, color="grey", lw=0.6)
    ax2.set_ylim(0, 1.1)
    ax2.set_ylabel("applied / offered")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    ax.set_title("Event-to-index lag vs offered load (publisher, Kafka, member: separate processes)", fontsize=9)
    return _save(fig, d, "lag")


def plot_score(d: Path, r: dict):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, row in r["sizes"].items():
        lens = [k for k in row if k.endswith("k") and isinstance(row[k], dict)]
        xs = [int(k[:-1]) * 1024 for k in lens]
        for mode, st in (("with_hashing", "-"), ("without_hashing", "--")):
            for p, mk in (("p50", "o"), ("p99", "s")):
                ax.plot(xs, [row[k][mode][p] for k in lens], mk + st, label=f"{label} {mode.replace('_', ' ')} {p}")
    ax.axhline(SMG_SCORE_P99_US, color="red", lw=0.8, ls=":", label="SMG p99 7.6 us (theirs, no hashing)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("score latency, us")
    ax.legend(fontsize=6, ncol=2)
    ax.set_title("Score latency, 256 workers", fontsize=9)
    return _save(fig, d, "score_latency")


def plot_apply(d: Path, r: dict):
    plt = _plt()
    st = dict(r["stages_blocks_per_s"])
    names = ["end_to_end"] + list(st)
    vals = [r["apply_blocks_per_s"]] + list(st.values())
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.barh(names, vals, color=["C3"] + ["C0"] * len(st))
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v / 1e3:,.0f}k", va="center", fontsize=8)
    ax.set_xlabel("blocks/s (one process)")
    ax.set_title("Apply rate: end to end and each stage alone", fontsize=9)
    return _save(fig, d, "apply_rate")


def plot_publish(d: Path, r: dict):
    plt = _plt()
    ps = ["p50", "p99", "p99.9", "max"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in r["runs"].items():
        ax.plot(ps, [run[p] for p in ps], "o-", label=name)
    ax.set_yscale("log")
    ax.set_ylabel("engine-thread cost of one publish(), us")
    ax.legend(fontsize=8)
    ax.set_title("publish() cost percentiles", fontsize=9)
    return _save(fig, d, "publish_cost")


def plot_codec(d: Path, r: dict):
    plt = _plt()
    names = list(r["codecs"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    a1.barh(names, [r["codecs"][n]["decode_blocks_per_s"] for n in names])
    a1.set_xlabel("decode, blocks/s")
    a2.barh(names, [r["codecs"][n]["bytes_per_block"] for n in names])
    a2.set_xlabel("bytes per block")
    a2.set_yticklabels([])
    fig.suptitle(f"Codecs, {r.get('blocks_per_record')} blocks per record", fontsize=9)
    return _save(fig, d, "codec")


def plot_memory(d: Path, r: dict):
    plt = _plt()
    rows = sorted(
        (v for v in r.values() if isinstance(v, dict) and "holder_blocks" in v), key=lambda v: v["holder_blocks"]
    )
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([v["holder_blocks"] for v in rows], [v["bytes_per_holder_block"] for v in rows], "o-", label="kvwire")
    ax.axhline(SMG_BYTES_PER_HOLDER_BLOCK, color="red", ls=":", label="SGLang SMG 26.9 B (theirs)")
    ax.set_xscale("log")
    ax.set_ylim(0, None)
    ax.set_xlabel("holder-blocks")
    ax.set_ylabel("index bytes per holder-block")
    ax.legend(fontsize=8)
    return _save(fig, d, "index_memory")


def plot_soak(d: Path, r: dict):
    """RssAnon and the index's own bytes over a soak run (bench/soak.py), holder-blocks beside."""
    plt = _plt()
    ser = r["series"]
    t = [s["t_s"] for s in ser]
    mib = lambda k: [s[k] / 2**20 for s in ser]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(t, mib("rss_anon_bytes"), "-", label="process RssAnon")
    ax.plot(t, mib("index_nbytes"), "-", label="index nbytes() (its own count)")
    if r.get("warmup_end_s") is not None:
        ax.axvline(r["warmup_end_s"], color="grey", lw=0.8, ls="--", label="end of warm-up")
    if t:
        ax.axvspan(0.9 * t[-1], t[-1], color="grey", alpha=0.15, label="last 10%")
    ax.set_ylim(0, None)
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax2 = ax.twinx()
    ax2.plot(t, [s["holder_blocks"] for s in ser], "k:", lw=0.8, label="holder-blocks")
    ax2.set_ylim(0, None)
    ax2.set_ylabel("holder-blocks")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="lower right", fontsize=8)
    p = r["params"]
    g = r.get("soak_rss_growth_pct")
    ax.set_title(
        f"Soak: {p['workers']} workers, {p['holder_blocks']:,} holder-blocks, {r['achieved_stored_blocks_per_s']:,} "
        f"stored blocks/s; RssAnon growth after warm-up {'n/a' if g is None else f'{g:.2f}%'}",
        fontsize=9,
    )
    return _save(fig, d, "soak")


PLOTS = {
    "lag": plot_lag,
    "score_latency": plot_score,
    "apply_rate": plot_apply,
    "publish_cost": plot_publish,
    "codec": plot_codec,
    "index_memory": plot_memory,
    "soak": plot_soak,
}


def make_all(d: Path) -> list[Path]:
    d = Path(d)
    out = []
    for name, fn in PLOTS.items():
        r = _load(d, name)
        if r is None:
            continue
        out.append(fn(d, r))
        _plt().close("all")
    return out


if __name__ == "__main__":
    from .common import RESULTS

    for p in make_all(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS):
        print("wrote", p)
