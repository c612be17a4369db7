"""PNG plots (needs matplotlib, the ``[bench]`` extra): throughput against concurrency per
system, latency CDFs, and the sweep."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

PLOTS = ("throughput.png", "latency_cdf.png")
SWEEP_PLOT = "sweep.png"


def available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _series_name(row: Mapping[str, Any], swept: bool) -> str:
    return f"{row['system']} {row['setting_label']}" if swept else row["system"]


def write_plots(rows: Sequence[Mapping[str, Any]], folder: Path) -> list[Path]:
    """Write the plots into ``folder``; returns their paths (none without matplotlib)."""
    if not available() or not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    swept = len({r["setting_label"] for r in rows}) > 1
    series: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        series[_series_name(r, swept)].append(r)
    color = {name: f"C{i % 10}" for i, name in enumerate(series)}  # one colour per system in every plot
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rs in series.items():
        rs = sorted(rs, key=lambda r: r["concurrency"])
        ax.plot([r["concurrency"] for r in rs], [r["metrics"]["output_throughput"] for r in rs], marker="o", label=name, color=color[name])
    ax.set(xlabel="concurrent requests", ylabel="output tokens/s", title="Throughput against concurrency")
    ax.set_xscale("log", base=2)
    levels = sorted({r["concurrency"] for r in rows})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, folder / PLOTS[0]))

    top = max(r["concurrency"] for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "e2el_ms", "End-to-end latency")):
        for name, rs in series.items():
            values = sorted(v for r in rs if r["concurrency"] == top for v in r["samples"][key])
            if values:
                ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=name, color=color[name])
        ax.set(xlabel="ms", ylabel="fraction of requests", title=f"{title} CDF, concurrency {top}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    written.append(_save(fig, folder / PLOTS[1]))

    if swept:
        written.append(_sweep_plot(plt, rows, top, folder / SWEEP_PLOT))
    return written


def _sweep_plot(plt: Any, rows: Sequence[Mapping[str, Any]], top: int, path: Path) -> Path:
    at_top = [r for r in rows if r["concurrency"] == top and len(r["setting"])]
    labels = list(dict.fromkeys(r["setting_label"] for r in at_top))
    systems = list(dict.fromkeys(r["system"] for r in at_top))
    goodput = any(r["metrics"]["request_goodput"] is not None for r in at_top)
    fig, axes = plt.subplots(1, 2 if goodput else 1, figsize=(10 if goodput else 6, 4.2), squeeze=False)
    width = 0.8 / max(1, len(systems))
    metrics = [("output_throughput", "output tokens/s")] + ([("request_goodput", "goodput (requests/s)")] if goodput else [])
    for ax, (key, ylabel) in zip(axes[0], metrics):
        for i, system in enumerate(systems):
            values = {r["setting_label"]: r["metrics"][key] or 0.0 for r in at_top if r["system"] == system}
            ax.bar([j + i * width for j in range(len(labels))], [values.get(lb, 0.0) for lb in labels], width, label=system)
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(labels))], labels, rotation=20, fontsize=8)
        ax.set(ylabel=ylabel, title=f"Sweep at concurrency {top}")
        ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
