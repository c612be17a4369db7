"""Results out: a markdown table (stdout), a JSON file for machines."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence


def _fmt(value: Optional[float], digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _pair(stat: Mapping[str, Optional[float]], a: str = "p50", b: str = "p99") -> str:
    if stat[a] is None:
        return "n/a"
    return f"{stat[a]:.0f} / {stat[b]:.0f}"


def markdown_table(rows: Sequence[Mapping[str, Any]], show_goodput: bool) -> str:
    """One line per (system, setting, concurrency)."""
    swept = len({r["setting_label"] for r in rows}) > 1
    head = ["system"] + (["setting"] if swept else []) + ["concurrency", "ok / failed", "output tok/s", "total tok/s", "req/s"]
    head += (["goodput req/s"] if show_goodput else []) + [
        "TTFT p50 / p99 ms", "TPOT p50 ms", "ITL p50 ms", "E2E p50 / p99 ms", "peak MB", "max batch", "EOS"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        m = r["metrics"]
        cells = [r["system"]] + ([r["setting_label"]] if swept else []) + [
            str(r["concurrency"]), f"{m['completed']} / {m['failed']}", _fmt(m["output_throughput"]),
            _fmt(m["total_token_throughput"]), _fmt(m["request_throughput"], 2)]
        cells += ([_fmt(m["request_goodput"], 2)] if show_goodput else []) + [
            _pair(m["ttft_ms"]), _fmt(m["tpot_ms"]["p50"]), _fmt(m["itl_ms"]["p50"]), _pair(m["e2el_ms"]),
            _fmt(m["peak_memory_mb"], 0), "n/a" if m["max_decode_batch"] is None else str(m["max_decode_batch"]), r["eos"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(rows: Sequence[Mapping[str, Any]], skipped: Mapping[str, str], best_lines: Sequence[str]) -> str:
    """Lines under the table: skipped systems, failures by kind, the best settings."""
    out = [f"- skipped {system}: {reason}" for system, reason in skipped.items()]
    for r in rows:
        if r["metrics"]["failures"]:
            kinds = ", ".join(f"{k} x{v}" for k, v in r["metrics"]["failures"].items())
            out.append(f"- {r['system']} ({r['setting_label']}, concurrency {r['concurrency']}) failures: {kinds}")
    for r in rows:
        for kind in ("speculation", "fast_forward"):
            drafted = r["metrics"].get(f"{kind}_draft_tokens")
            if drafted:
                accepted = r["metrics"][f"{kind}_accepted_tokens"]
                out.append(f"- {r['system']} ({r['setting_label']}, concurrency {r['concurrency']}) {kind.replace('_', ' ')}: "
                           f"{accepted} of {drafted} draft tokens accepted ({accepted / drafted:.0%}), "
                           f"{accepted / r['num_requests']:.1f} a request")
    out += [f"- {line}" for line in attention_lines(rows)]
    out += [f"- {line}" for line in sweep_ratios(rows)]
    out += [f"- {line}" for line in best_lines]
    out.append("- peak MB: MLX peak memory for in-process systems, the server's peak RSS for servers started here; "
               "max batch: largest decode batch from engine.stats() (llama-cpp: most sequences in one llama_decode)")
    return "\n".join(out)


def attention_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """For each of this package's systems (and setting): its model's backend and how that read
    the paged KV, as ``Engine.stats()`` said after each run (every path seen, should it change)."""
    seen: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        m = r["metrics"]
        if m.get("attention"):
            paths = seen.setdefault((r["system"], r["setting_label"]), [])
            path = f"{m.get('backend')} backend, attention: {m['attention']}" + (f", decode steps {m['decode']}" if m.get("decode") else "")
            if path not in paths:
                paths.append(path)
    return [f"{system} ({label}): {'; then '.join(paths)}" for (system, label), paths in seen.items()]


def sweep_ratios(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per system and concurrency level with more than one setting: each setting's output
    tok/s against the first setting's. A setting given more than once in ``--sweep`` (e.g.
    ``speculative=off,ngram,off,ngram,off,ngram``) runs that many times, in turn with the
    others, and is taken by its median: on a shared machine one run of each can differ by
    more than the effect measured."""
    groups: dict[tuple[str, int], dict[str, list[float]]] = {}
    for r in rows:
        tok_s = r["metrics"].get("output_throughput")
        if tok_s:
            groups.setdefault((r["system"], r["concurrency"]), {}).setdefault(r["setting_label"], []).append(tok_s)

    def runs(values: list[float]) -> str:
        middle = statistics.median(values)
        return f"{middle:.1f}" if len(values) == 1 else f"median {middle:.1f} of {len(values)}: " + " / ".join(f"{v:.1f}" for v in values)

    out = []
    for (system, concurrency), by in groups.items():
        if len(by) < 2:
            continue
        (first, base), *others = by.items()
        ratios = "; ".join(f"{label} {statistics.median(v) / statistics.median(base):.2f}x ({runs(v)})" for label, v in others)
        out.append(f"{system}, concurrency {concurrency}, output tok/s against {first} ({runs(base)}): {ratios}")
    return out


def write_json(path: Path, result: Mapping[str, Any]) -> Path:
    """Write the whole result (meta, rows with per-request samples, skipped, best), whole or
    not at all."""
    from ..models.kernel_cache import write_atomic

    write_atomic(path, (json.dumps(result, indent=2, default=str) + "\n").encode(), 0o644)
    return path
