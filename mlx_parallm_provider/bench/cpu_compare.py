"""The CPU targets, measured: this package's engine (and its LiteLLM proxy) against llama.cpp
(same GGUF: ``llama-server`` from the ``xllamacpp`` wheel over HTTP, and llama-cpp-python in
process) and against ``mlx_lm.stream_generate`` (same weights), a process per system and level,
same prompts (the chat workload), 64 new tokens each (EOS ignored), plus the decode-step cost
at batch 64 with 512 tokens of context against 128.

    python -m mlx_parallm_provider.bench.cpu_compare [--systems engine litellm-proxy llama-server]
        [--concurrency 1 32 64] [--output-dir DIR]

Each system runs as ``mlx-parallm bench --systems <one>`` in a child process per concurrency
level (one stream: 4 prompts in turn); the figures are that command's aggregate output tok/s
and peak memory (MLX's peak in process, the server's peak RSS for servers; ``results.json`` of
each is kept under ``--output-dir``). Targets (:data:`TARGETS`): issue 23's against
llama-server (engine >= 1.5x at 64 concurrent and >= 1.0x at one stream, the proxy >= 1.2x at
64), and the earlier ones against llama-cpp-python and ``stream_generate``; step at 512
tokens of context <= 2x the step at 128; memory: the peak RSS of the process that served
(the engine's benchmark process, the proxy) <= 1.5x llama-server's at the same level, and MLX's
memory after loading the default model <= 1.5x its GGUF's size (a child process).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from ..config import child_environment
from ..cpu_info import cpu_model_name
from ..doctor import cpu_features

TARGETS = {
    ("engine", "llama-server", 64): 1.5, ("litellm-proxy", "llama-server", 64): 1.2, ("engine", "llama-server", 1): 1.0,
    ("engine", "llama-cpp", 64): 1.2, ("engine", "llama-cpp", 32): 1.0, ("engine", "mlx-lm", 1): 2.0,
}
"""``(ours, peer, concurrency) -> the least tok/s ratio ours / peer``."""
STEP_TARGET = 2.0
RSS_TARGET = 1.5
"""Issue 23: a process of ours (the engine's, the proxy's) peaks at most this times llama-server's RSS."""
LOAD_TARGET = 1.5
"""Issue 23: MLX memory after loading the default model at most this times its GGUF's size."""


ONE_STREAM_PROMPTS = 4
"""Prompts served one after another at concurrency 1 (one 64-token answer is too short a sample)."""


def _bench(name: str, system: str, level: int, max_tokens: int, out_dir: Path, env: dict[str, str],
           llama_cpp_threads: Optional[int]) -> Optional[dict[str, Any]]:
    """One ``mlx-parallm bench`` child at one concurrency level; its row of results.json."""
    folder = out_dir / name / f"c{level}"
    cmd = [sys.executable, "-m", "mlx_parallm_provider.cli", "bench", "--systems", system, "--workload", "chat",
           "--max-tokens", str(max_tokens), "--ignore-eos", "--concurrency", str(level),
           "--num-prompts", str(max(level, ONE_STREAM_PROMPTS)), "--output-dir", str(folder), "--no-progress"]
    if system in ("llama-cpp", "llama-server") and llama_cpp_threads:
        cmd += ["--llama-cpp-threads", str(llama_cpp_threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    results = folder / "results.json"
    if out.returncode != 0 or not results.exists():
        print(f"{name} at {level}: failed or skipped\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return next((r for r in json.loads(results.read_text())["rows"] if r["system"] == system), None)


def run_system(name: str, levels: Sequence[int], max_tokens: int, out_dir: Path,
               llama_cpp_threads: Optional[int] = None) -> tuple[dict[int, float], dict[int, Optional[float]], dict[int, Optional[float]]]:
    """Aggregate output tok/s, peak memory (MB: MLX's in process, else the server's RSS) and the
    peak RSS (MB) of the process that served, of system ``name`` at each concurrency level, each level in a
    process of its own ("engine-before": the engine on MLX's own ops, ``MLX_PARALLM_CPU_OPS=0``
    and no packed small-step kernel). At level 1, :data:`ONE_STREAM_PROMPTS` prompts in turn."""
    system = "engine" if name == "engine-before" else name
    env = child_environment(LITELLM_LOCAL_MODEL_COST_MAP="True",
                            **({"MLX_PARALLM_CPU_OPS": "0", "MLX_PARALLM_SMALL_BATCH_ROWS": "0"} if name == "engine-before" else {}))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    rows = [row for level in levels if (row := _bench(name, system, level, max_tokens, out_dir, env, llama_cpp_threads))]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if not rows:
        return {}, {}, {}
    tokens = sum(r["metrics"]["total_output_tokens"] for r in rows)
    print(f"{name}: {tokens} tokens for {cpu_s:.1f} CPU-seconds of its processes (load, warm-up and all levels): "
          f"{tokens / cpu_s if cpu_s else float('nan'):.1f} tokens per CPU-second", file=sys.stderr)
    return ({r["concurrency"]: r["metrics"]["output_throughput"] for r in rows},
            {r["concurrency"]: r["metrics"].get("peak_memory_mb") for r in rows},
            {r["concurrency"]: r["metrics"].get("peak_rss_mb") for r in rows})


def step_ratio(repeats: int = 5, model: str = "default", batch: int = 64) -> Optional[dict[str, float]]:
    """Wall-clock decode step (forward + argmax) of ``model`` at ``batch`` rows with 128 and 512
    tokens of context, interleaved, best of ``repeats``, in a child process."""
    code = (
        "import mlx_parallm_provider, json\n"
        "from mlx_parallm_provider.bench.cpu_profile import decode_step_ms\n"
        "from mlx_parallm_provider.models import registry\n"
        f"ms = decode_step_ms(registry.load({model!r}).model, {batch}, (128, 512), {repeats})\n"
        "print('RESULT ' + json.dumps({str(c): v for c, v in ms.items()}))\n"
    )
    return _child_result(code, "decode-step")


def load_memory(model: str = "default") -> Optional[dict[str, float]]:
    """MLX's memory (MiB) once ``model`` is loaded, in a child process, and the size (MiB) of
    the default model's GGUF (``model`` "default" only: else no file size)."""
    code = (
        "import mlx_parallm_provider, json\n"
        "import mlx.core as mx\n"
        "from mlx_parallm_provider.models import registry\n"
        f"loaded = registry.load({model!r})\n"
        "mx.eval(loaded.model.parameters())\n"
        f"size = registry.default_gguf_path().stat().st_size if {model == 'default'} else 0\n"
        "print('RESULT ' + json.dumps({'mlx_mb': mx.get_active_memory() / 2**20, 'checkpoint_mb': size / 2**20}))\n"
    )
    return _child_result(code, "load-memory")


def _child_result(code: str, what: str) -> Optional[dict[str, float]]:
    """Run ``code`` in a child Python; the JSON it printed after ``RESULT `` (its last such
    line), or None (said on stderr, with the child's) when it failed or printed none."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_environment(LITELLM_LOCAL_MODEL_COST_MAP="True"))
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        print(f"{what} child failed:\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1][len("RESULT "):])


def report(results: dict[str, dict[int, float]], steps: Optional[dict[str, float]],
           peaks: Optional[dict[str, dict[int, Optional[float]]]] = None,
           rss: Optional[dict[str, dict[int, Optional[float]]]] = None, load: Optional[dict[str, float]] = None) -> str:
    """The tok/s table (peak memory MB beside each figure where known), each target of
    :data:`TARGETS` between systems that ran, and the memory targets (:data:`RSS_TARGET`
    against llama-server's RSS, :data:`LOAD_TARGET` for MLX's memory after loading), as
    met / missed."""
    peaks, rss = peaks or {}, rss or {}
    levels = sorted({c for per in results.values() for c in per})
    lines = ["| system | " + " | ".join(f"{c} concurrent" for c in levels) + " |", "|---|" + "---:|" * len(levels)]
    for system, per in results.items():
        cells = []
        for c in levels:
            peak = peaks.get(system, {}).get(c)
            cells.append("-" if c not in per else f"{per[c]:.1f}" + (f" ({peak:.0f} MB)" if peak else ""))
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    lines.append("")
    for (mine, peer, c), target in TARGETS.items():
        if mine not in results or peer not in results:
            continue
        ours, theirs = results[mine].get(c), results[peer].get(c)
        if not ours or not theirs:
            lines.append(f"{mine} vs {peer} at {c}: not measured")
            continue
        ratio = ours / theirs
        lines.append(f"{mine} vs {peer} at {c} concurrent: {ours:.1f} / {theirs:.1f} tok/s = {ratio:.2f}x "
                     f"(target >= {target}x: {'met' if ratio >= target else 'missed'})")
    theirs_rss = rss.get("llama-server", {})
    for mine in ("engine", "litellm-proxy"):
        for c, peak in sorted(rss.get(mine, {}).items()):
            if peak and theirs_rss.get(c):
                ratio = peak / theirs_rss[c]
                lines.append(f"peak RSS at {c} concurrent: {mine} {peak:.0f} MB vs llama-server {theirs_rss[c]:.0f} MB = {ratio:.2f}x "
                             f"(target <= {RSS_TARGET}x: {'met' if ratio <= RSS_TARGET else 'missed'})")
    if load and load.get("checkpoint_mb"):
        ratio = load["mlx_mb"] / load["checkpoint_mb"]
        lines.append(f"MLX memory after loading: {load['mlx_mb']:.0f} MB for a {load['checkpoint_mb']:.0f} MB checkpoint = {ratio:.2f}x "
                     f"(target <= {LOAD_TARGET}x: {'met' if ratio <= LOAD_TARGET else 'missed'})")
    if steps:
        ratio = steps["512"] / steps["128"]
        lines.append(f"decode step at batch 64: {steps['512']:.0f} ms at 512 tokens of context, {steps['128']:.0f} ms at 128 "
                     f"= {ratio:.2f}x (target <= {STEP_TARGET}x: {'met' if ratio <= STEP_TARGET else 'missed'})")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--systems", nargs="+", default=["engine", "llama-cpp", "mlx-lm"],
                        help="engine, engine-before (MLX's own CPU ops), litellm-proxy, llama-server, llama-cpp, mlx-lm")
    parser.add_argument("--output-dir", type=Path, default=Path("bench-results") / f"cpu-compare-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--no-step", action="store_true", help="skip the decode-step ratio")
    parser.add_argument("--no-load", action="store_true", help="skip MLX's memory after loading")
    parser.add_argument("--llama-cpp-threads", type=int, default=os.cpu_count() or 1,
                        help="llama.cpp's threads (default: all CPUs, its fastest at high concurrency here)")
    args = parser.parse_args(argv)
    results, peaks, rss = {}, {}, {}
    print(f"CPU: {cpu_model_name()}; vector features: {' '.join(cpu_features()) or 'unknown'}; {os.cpu_count()} CPUs", flush=True)
    for system in args.systems:
        levels = [1] if system == "mlx-lm" else args.concurrency  # stream_generate serves one at a time
        results[system], peaks[system], rss[system] = run_system(system, levels, args.max_tokens, args.output_dir, args.llama_cpp_threads)
    steps = None if args.no_step else step_ratio()
    load = None if args.no_load else load_memory()
    text = report(results, steps, peaks, rss, load)
    print(text)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "cpu_compare.json").write_text(
        json.dumps({"tok_s": results, "peak_mb": peaks, "peak_rss_mb": rss, "step_ms": steps, "load": load}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
