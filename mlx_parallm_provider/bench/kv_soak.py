"""A hard KV budget under a soak: random prompt and output lengths, every request answered.

    python -m mlx_parallm_provider.bench.kv_soak [--model default] [--budget-gb 0.2]
        [--requests 1000] [--concurrency 96]

An engine with ``kv_cache_memory_gb=--budget-gb`` (paged KV) serves ``--requests`` requests
(prompts of 10 to 300 words, 1 to 64 new tokens), at most ``--concurrency`` in flight.
Printed: requests answered and failed, preemptions, MLX's peak memory over the idle engine
(model loaded, pool not yet allocated) against the budget, and the memory back at idle after.
Target (issue 20): peak over idle within the budget plus activations; none failed.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--budget-gb", type=float, default=0.2)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)
    # isort: split
    import mlx.core as mx

    from mlx_parallm_provider.config import EngineConfig
    from mlx_parallm_provider.engine import Engine, SamplingParams

    from ..cpu_info import cpu_model_name

    engine = Engine(args.model, EngineConfig(kv_cache_memory_gb=args.budget_gb, max_num_seqs=64))
    idle = mx.get_active_memory()
    mx.reset_peak_memory()
    rng = random.Random(args.seed)
    words = "the a of model request batch token memory block cache prefix answer question agent tool".split()
    jobs = [(" ".join(rng.choice(words) for _ in range(rng.randrange(10, 301))), rng.randrange(1, 65)) for _ in range(args.requests)]
    failures: list[str] = []
    gate = asyncio.Semaphore(args.concurrency)
    done = [0]
    tic = time.perf_counter()

    async def one(prompt: str, n: int) -> int:
        async with gate:
            try:
                return len((await engine.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))).token_ids)
            except Exception as exc:  # counted and shown: the target is none
                failures.append(f"{type(exc).__name__}: {exc}")
                return 0
            finally:
                done[0] += 1
                if done[0] % 100 == 0:  # progress, so a long soak shows where it is
                    print(f"  {done[0]} answered after {time.perf_counter() - tic:.0f} s; peak over idle "
                          f"{(mx.get_peak_memory() - idle) / 1024**3:.3f} GiB; failed {len(failures)}", flush=True)

    async def run() -> int:
        return sum(await asyncio.gather(*(one(p, n) for p, n in jobs)))

    tokens = asyncio.run(run())
    wall = time.perf_counter() - tic
    stats = engine.stats()
    peak = (mx.get_peak_memory() - idle) / 1024**3
    kv = stats["kv_cache"]
    print(f"CPU: {cpu_model_name()}; budget {args.budget_gb} GiB; {args.requests} requests, {args.concurrency} in flight at most")
    print(f"answered {args.requests - len(failures)}, failed {len(failures)}; {tokens} tokens in {wall:.0f} s; "
          f"preemptions {kv.get('num_preemptions')}; pool {kv.get('kv_cache_bytes', 0) / 1024**3:.3f} GiB "
          f"({kv.get('kv_blocks_total')} blocks of {kv.get('kv_block_size')})")
    print(f"MLX peak over idle {peak:.3f} GiB = budget {args.budget_gb} + {peak - args.budget_gb:.3f} GiB "
          f"(activations, sampling); active after {(mx.get_active_memory() - idle) / 1024**3:.3f} GiB (the pool stays)")
    for f in failures[:5]:
        print("  failed:", f)
    engine.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
