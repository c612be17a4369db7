"""What a block table per group of layers saves on a model mixing sliding-window and global
layers (gemma3, gpt-oss), against one table for every layer, measured in one run.

    python -m mlx_parallm_provider.bench.kv_groups --model PATH_OR_GGUF [--long-tokens 3000]
        [--short 8] [--max-tokens 64]

Each mode runs in a child process of its own (so MLX's peak memory is that mode's): one long
request (its prefill done first) and ``--short`` short ones decoding beside it. Printed: the
KV arrays the pool holds at the end, MLX's peak memory over idle, the short rows' TPOT p50,
and whether both modes' greedy tokens are the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any, Sequence

from ..cpu_info import cpu_model_name
from .kv_memory import _stream_times, _tpot, run_child


def _measure(model: str, mode: str, short: int, long_tokens: int, max_tokens: int) -> dict[str, Any]:
    import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)
    # isort: split
    import mlx.core as mx

    from mlx_parallm_provider.config import EngineConfig
    from mlx_parallm_provider.engine import Engine, SamplingParams
    from mlx_parallm_provider.engine.kv import groups

    if mode == "one-table":
        groups.MAX_GROUPS = 1  # every layer in one group: a block holds every layer's K/V
    engine = Engine(model, EngineConfig(enable_prefix_caching=False))
    tok = engine.tokenizer
    prompts = [f"Question {i}: name one fact about the number {i}." for i in range(short)]
    long_prompt = tok.encode(" ".join(f"item {i} is a piece of the long document." for i in range(long_tokens)))[:long_tokens]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate_sync("warm up", SamplingParams(max_tokens=4))
    idle = mx.get_active_memory()
    mx.reset_peak_memory()

    async def run() -> tuple[list[int], list[list[int]], list[float]]:
        started, long_ids = asyncio.Event(), []

        async def long_row() -> None:
            async for delta in engine.stream(long_prompt, SamplingParams(max_tokens=4 * max_tokens, ignore_eos=True)):
                long_ids.extend(delta.token_ids)
                started.set()

        task = asyncio.create_task(long_row())
        await started.wait()
        times = await asyncio.gather(*(_stream_times(engine, p, params) for p in prompts))
        await task
        shorts = [c.token_ids for c in await asyncio.gather(*(engine.generate(p, params) for p in prompts))]
        return long_ids, shorts, [_tpot(t) for t in times]

    tic = time.perf_counter()
    long_ids, shorts, tpots = asyncio.run(run())
    kv = engine.stats()["kv_cache"]
    out = {"mode": mode, "groups": len(engine._core.kv.windows), "kv_arrays_mb": kv.get("kv_cache_bytes", 0) / 1024**2,  # noqa: SLF001
           "peak_mb": (mx.get_peak_memory() - idle) / 1024**2, "short_tpot_ms": 1000 * statistics.median(tpots),
           "wall_s": time.perf_counter() - tic, "tokens": hash((tuple(long_ids), tuple(map(tuple, shorts))))}
    engine.shutdown()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model with sliding-window and global layers (a folder or .gguf)")
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(args.model, args.child, args.short, args.long_tokens, args.max_tokens)))
        return 0
    print(f"CPU: {cpu_model_name()}; {os.cpu_count()} CPUs; one request of {args.long_tokens} tokens (+{4 * args.max_tokens}), "
          f"{args.short} short ones beside it (+{args.max_tokens})")
    options = {"model": args.model, "short": args.short, "long_tokens": args.long_tokens, "max_tokens": args.max_tokens}
    runs = [run_child("mlx_parallm_provider.bench.kv_groups", mode, options) for mode in ("groups", "one-table")]
    for r in runs:
        print(f"{r['mode']:>9}: {r['groups']} table(s) a request; KV arrays {r['kv_arrays_mb']:.1f} MB, MLX peak over idle "
              f"{r['peak_mb']:.1f} MB, short rows' TPOT p50 {r['short_tpot_ms']:.1f} ms, {r['wall_s']:.1f} s")
    grouped, single = runs
    print(f"groups / one table: KV arrays {grouped['kv_arrays_mb'] / max(single['kv_arrays_mb'], 1e-9):.2f}x, peak "
          f"{grouped['peak_mb'] / max(single['peak_mb'], 1e-9):.2f}x, TPOT {grouped['short_tpot_ms'] / single['short_tpot_ms']:.2f}x; "
          f"same greedy tokens: {grouped['tokens'] == single['tokens']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
