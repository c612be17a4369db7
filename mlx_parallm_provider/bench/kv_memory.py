"""What one long request costs the short ones, measured in one run.

    python -m mlx_parallm_provider.bench.kv_memory [--model default] [--short 32]
        [--long-tokens 2000] [--max-tokens 48]

In a child process of its own (so MLX's peak memory is the engine's alone):

1. ``--short`` short chat requests decode alone: their TPOT p50 and MLX's peak memory over idle;
2. the same beside one long request that was started first (its prefill done before they
   arrive): their TPOT p50 against (1), and the extra peak memory against the long row's own
   KV (its tokens x bytes per token);
3. the short requests decoding when the long prompt arrives: the longest gap between two
   tokens of a short row while the long prompt is prefilled in chunks of
   ``prefill_chunk_size`` tokens (the knob that bounds it).

Targets (issue 20): (2) TPOT at most 1.2x (1), extra peak at most the long row's KV + 25%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

from ..cpu_info import cpu_model_name

TPOT_TARGET = 1.2
MEMORY_TARGET = 1.25


async def _stream_times(engine: Any, prompt: Any, params: Any) -> list[float]:
    """Arrival time of each token of one streamed request."""
    times: list[float] = []
    async for delta in engine.stream(prompt, params):
        times.extend([time.perf_counter()] * len(delta.token_ids))
    return times


def _tpot(times: list[float]) -> float:
    return (times[-1] - times[0]) / max(1, len(times) - 1)


def _measure(model: str, short: int, long_tokens: int, max_tokens: int, chunk: int) -> dict[str, Any]:
    import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)
    # isort: split
    import mlx.core as mx

    from mlx_parallm_provider.config import EngineConfig
    from mlx_parallm_provider.engine import Engine, SamplingParams

    engine = Engine(model, EngineConfig(prefill_chunk_size=chunk, max_num_seqs=max(64, short + 1)))
    tok = engine.tokenizer
    prompts = [f"Question {i}: name one fact about the number {i}." for i in range(short)]
    long_prompt = tok.encode(" ".join(f"item {i} is a piece of the long document." for i in range(long_tokens)))[:long_tokens]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate_sync("warm up", SamplingParams(max_tokens=4))

    async def shorts() -> list[list[float]]:
        return await asyncio.gather(*(_stream_times(engine, p, params) for p in prompts))

    def peak_over(idle: int) -> float:
        return (mx.get_peak_memory() - idle) / 1024**2

    # Both peaks over the same idle (before the short rows' first run): the paged pool keeps
    # what it grew to in (1), so an idle taken again before (2) would leave the short rows'
    # KV out of (2) but in (1), and understate the long row's cost.
    idle = mx.get_active_memory()
    mx.reset_peak_memory()
    alone = asyncio.run(shorts())
    out: dict[str, Any] = {"alone_tpot_ms": 1000 * statistics.median(map(_tpot, alone)),
                           "alone_peak_mb": peak_over(idle)}

    async def beside() -> tuple[list[list[float]], list[float]]:
        long_params = SamplingParams(max_tokens=4 * max_tokens, ignore_eos=True)
        started = asyncio.Event()
        long_times: list[float] = []

        async def long_row() -> None:
            async for delta in engine.stream(long_prompt, long_params):
                long_times.extend([time.perf_counter()] * len(delta.token_ids))
                started.set()

        task = asyncio.create_task(long_row())
        await started.wait()  # its prefill is done
        rows = await shorts()
        await task
        return rows, long_times

    mx.reset_peak_memory()
    rows, _ = asyncio.run(beside())
    out["beside_tpot_ms"] = 1000 * statistics.median(map(_tpot, rows))
    out["beside_peak_mb"] = peak_over(idle)
    bytes_per_token = engine._kv_bytes_per_token  # noqa: SLF001 (an estimate the engine already makes)
    out["long_row_kv_mb"] = (len(long_prompt) + 4 * max_tokens) * bytes_per_token / 1024**2

    async def arriving() -> float:
        tasks = [asyncio.create_task(_stream_times(engine, p, SamplingParams(max_tokens=3 * max_tokens, ignore_eos=True))) for p in prompts]
        await asyncio.sleep(2.0)  # the short rows are decoding
        arrival = time.perf_counter()
        await engine.generate(long_prompt, SamplingParams(max_tokens=1))
        done = time.perf_counter()
        rows = await asyncio.gather(*tasks)
        gaps = [b - a for r in rows for a, b in zip(r, r[1:]) if arrival <= b <= done + 1e-3]
        return max(gaps, default=0.0)

    out["max_gap_during_long_prefill_ms"] = 1000 * asyncio.run(arriving())
    out["prefill_chunk_size"] = chunk
    out["kv_cache"] = engine.stats()["kv_cache"]
    engine.shutdown()
    return out


def run_child(module: str, options: dict[str, Any]) -> dict[str, Any]:
    """Run ``python -m module --child --option value ...`` (in a process of its own, so MLX's
    peak memory is that run's); the JSON it prints last."""
    cmd = [sys.executable, "-m", module, "--child", *(x for k, v in options.items() for x in (f"--{k.replace('_', '-')}", str(v)))]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--short", type=int, default=32)
    ap.add_argument("--long-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prefill-chunk-size", type=int, default=512)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(args.model, args.short, args.long_tokens, args.max_tokens, args.prefill_chunk_size)))
        return 0
    print(f"CPU: {cpu_model_name()}; {os.cpu_count()} CPUs; {args.short} short requests, one of {args.long_tokens} tokens, {args.max_tokens} new tokens each")
    r = run_child("mlx_parallm_provider.bench.kv_memory", {k: v for k, v in vars(args).items() if k != "child"})
    ratio = r["beside_tpot_ms"] / r["alone_tpot_ms"]
    extra = r["beside_peak_mb"] - r["alone_peak_mb"]
    print(f"short TPOT p50 alone {r['alone_tpot_ms']:.1f} ms, beside the long row {r['beside_tpot_ms']:.1f} ms "
          f"({ratio:.2f}x; target <= {TPOT_TARGET}x: {'met' if ratio <= TPOT_TARGET else 'missed'})")
    print(f"MLX peak over idle: alone {r['alone_peak_mb']:.0f} MB, beside {r['beside_peak_mb']:.0f} MB; extra "
          f"{extra:.0f} MB vs the long row's own KV {r['long_row_kv_mb']:.0f} MB ({extra / r['long_row_kv_mb']:.2f}x; "
          f"target <= {MEMORY_TARGET}x: {'met' if extra <= MEMORY_TARGET * r['long_row_kv_mb'] else 'missed'})")
    print(f"while the long prompt is prefilled (prefill_chunk_size={r['prefill_chunk_size']}), the short rows' "
          f"longest gap between tokens: {r['max_gap_during_long_prefill_ms']:.0f} ms")
    print(f"kv_cache: {r['kv_cache']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
