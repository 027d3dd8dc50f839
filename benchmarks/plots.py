"""PNG plots of benchmark results with matplotlib (Agg backend, no display needed).

Each function takes run entries (see ``report``) whose ``records`` hold per-request dicts where needed,
and writes one PNG.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

Run = Mapping[str, Any]
BUCKETS = ("0-512", "512-2048", "2048+")


def throughput_bars(runs: Sequence[Run], path: str | Path, title: str) -> None:
    """Output tokens per second, one horizontal bar per run, labelled with the value."""
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(runs) + 1.2))
    labels = [f"{r['system']} ({r['scenario']})" for r in runs]
    values = [r["metrics"]["output_throughput"] for r in runs]
    bars = ax.barh(range(len(runs)), values, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f", padding=3)
    ax.set_yticks(range(len(runs)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("output tokens / s")
    ax.set_xlim(0, max(values, default=1.0) * 1.15)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ttft_cdf(runs: Sequence[Run], path: str | Path, title: str) -> None:
    """Empirical CDF of TTFT (seconds, log x) per run, from successful per-request records."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        ttfts = sorted(r["ttft_s"] for r in run["records"] if r["success"])
        if not ttfts:
            continue
        fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        ax.step(ttfts, fractions, where="post", label=f"{run['system']} ({run['scenario']})")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def p99_by_bucket(runs: Sequence[Run], path: str | Path, title: str, metric: str = "ttft") -> None:
    """Grouped bars: p99 of ``metric`` (``ttft``, ``itl``, ``tpot``, ``e2el``; ms) per input-length bucket."""
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(runs), 1)
    for index, run in enumerate(runs):
        values = [run["metrics"]["p99_by_bucket_ms"][b][metric] or 0.0 for b in BUCKETS]
        positions = [b + index * width for b in range(len(BUCKETS))]
        ax.bar(positions, values, width, label=f"{run['system']} ({run['scenario']})")
    ax.set_xticks([b + 0.4 - width / 2 for b in range(len(BUCKETS))], [f"prompt {b} tokens" for b in BUCKETS])
    ax.set_ylabel(f"p99 {metric.upper()} (ms)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chunked_prefill_tradeoff(runs: Sequence[Run], path: str | Path, title: str) -> None:
    """p99 TTFT, p99 and max ITL (ms) against ``max_num_batched_tokens`` (runs carry it as ``chunk_tokens``)."""
    ordered = sorted(runs, key=lambda r: r["chunk_tokens"])
    chunks = [r["chunk_tokens"] for r in ordered]
    fig, ax_ttft = plt.subplots(figsize=(6.5, 4))
    ax_itl = ax_ttft.twinx()
    ttft = [r["metrics"]["ttft_ms"]["p99"] for r in ordered]
    ax_ttft.plot(chunks, ttft, "o-", color="tab:blue", label="TTFT p99")
    ax_itl.plot(
        chunks, [r["metrics"]["itl_ms"]["p99"] for r in ordered], "s--", color="tab:red", label="ITL p99"
    )
    ax_itl.plot(
        chunks, [r["metrics"]["itl_ms"]["max"] for r in ordered], "^:", color="tab:orange", label="ITL max"
    )
    ax_ttft.set_xscale("log", base=2)
    ax_ttft.set_xticks(chunks, [str(c) for c in chunks])
    ax_ttft.set_xlabel("--max-num-batched-tokens")
    ax_ttft.set_ylabel("p99 TTFT (ms)", color="tab:blue")
    ax_itl.set_ylabel("inter-token latency (ms)", color="tab:red")
    ax_ttft.set_ylim(0, max(ttft) * 1.3)
    ax_itl.set_ylim(0, None)
    ax_ttft.set_title(title)
    handles = ax_ttft.get_legend_handles_labels()[0] + ax_itl.get_legend_handles_labels()[0]
    ax_ttft.legend(handles=handles, fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ratio_heat_map(
    panels: Mapping[Any, Mapping[tuple[Any, Any], float | None]],
    path: str | Path,
    title: str,
    row_label: str,
    col_label: str,
) -> None:
    """One heat map per panel (titled by its key) of ratios keyed (row, column), each cell annotated;
    green above 1, red below (log scale, 0.25x to 4x). A missing ratio is a grey cell."""
    from matplotlib.colors import LogNorm

    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.5, 4.2 * len(panels)), 4.2), squeeze=False)
    norm = LogNorm(vmin=0.25, vmax=4.0)
    image = None
    for ax, (key, cells) in zip(axes[0], panels.items(), strict=True):
        rows = sorted({r for r, _ in cells})
        cols = sorted({c for _, c in cells})
        values = [[cells.get((r, c)) or float("nan") for c in cols] for r in rows]
        image = ax.imshow(values, cmap="RdYlGn", norm=norm, origin="lower")
        for i, row in enumerate(values):
            for j, value in enumerate(row):
                ax.text(
                    j, i, "-" if value != value else f"{value:.2f}x", ha="center", va="center", fontsize=9
                )
        ax.set_xticks(range(len(cols)), [str(c) for c in cols])
        ax.set_yticks(range(len(rows)), [str(r) for r in rows])
        ax.set_xlabel(col_label)
        ax.set_title(f"output {key}", fontsize=9)
    axes[0][0].set_ylabel(row_label)
    if image is not None:
        ticks = [0.25, 0.5, 1.0, 2.0, 4.0]
        bar = fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8, ticks=ticks)
        bar.ax.set_yticklabels([f"{t:g}x" for t in ticks])
        bar.ax.minorticks_off()
    fig.suptitle(title, fontsize=9, wrap=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
