"""What rows joining and leaving cost the decode steps, in one run.

    python -m mlx_parallm_provider.bench.kv_churn [--model default] [--requests 192]
        [--rows 64] [--request-rate 8]

In a child process: ``--requests`` chat requests with random output lengths
(8 to 96 tokens) into an engine of ``--rows`` rows, first as Poisson arrivals at
``--request-rate`` per second, then all at once (a burst). Every decode step is timed; a
step is a *churn* step when the batch's rows differ from the step before (a row joined or
left). Printed: the median step at (nearly) full batch with and without churn, their ratio
(target: within 10%), and each arrival pattern's output tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any, Sequence

CHURN_TARGET = 1.10


def _measure(model: str, requests: int, rows: int, rate: float, seed: int) -> dict[str, Any]:
    import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)
    from mlx_parallm_provider.config import EngineConfig
    from mlx_parallm_provider.engine import Engine, SamplingParams
    from mlx_parallm_provider.engine.runner import ModelRunner

    steps: list[tuple[int, float, bool]] = []
    last: list[set[int]] = [set()]
    decode = ModelRunner._decode

    def timed(self: ModelRunner, plan: Any, rows: list[Any], out: Any) -> None:
        ids = {id(r) for r in rows}
        tic = time.perf_counter()
        decode(self, plan, rows, out)
        steps.append((len(ids), time.perf_counter() - tic, ids != last[0]))
        last[0] = ids

    ModelRunner._decode = timed  # type: ignore[method-assign]
    engine = Engine(model, EngineConfig(max_num_seqs=rows))
    engine.generate_sync("warm up", SamplingParams(max_tokens=4))
    rng = random.Random(seed)
    prompts = [f"Request {i}: tell me about the number {rng.randrange(1000)}." for i in range(requests)]
    lengths = [rng.randrange(8, 97) for _ in range(requests)]

    async def run(gaps: Sequence[float]) -> float:
        async def one(i: int, delay: float) -> int:
            await asyncio.sleep(delay)
            c = await engine.generate(prompts[i], SamplingParams(max_tokens=lengths[i], ignore_eos=True))
            return len(c.token_ids)

        tic = time.perf_counter()
        delays = [sum(gaps[: i + 1]) for i in range(requests)]
        done = await asyncio.gather(*(one(i, d) for i, d in enumerate(delays)))
        return sum(done) / (time.perf_counter() - tic)

    out: dict[str, Any] = {}
    for name, gaps in (("poisson", [rng.expovariate(rate) for _ in range(requests)]), ("burst", [0.0] * requests)):
        steps.clear()
        out[f"{name}_tok_s"] = asyncio.run(run(gaps))
        full = [(dt, churn) for n, dt, churn in steps if n >= int(0.75 * rows)]
        quiet, churned = [dt for dt, c in full if not c], [dt for dt, c in full if c]
        out[f"{name}_steps"] = {"quiet": len(quiet), "churn": len(churned),
                                "quiet_ms": 1000 * statistics.median(quiet) if quiet else None,
                                "churn_ms": 1000 * statistics.median(churned) if churned else None}
    engine.shutdown()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(args.model, args.requests, args.rows, args.request_rate, args.seed)))
        return 0
    from ..cpu_info import cpu_model_name
    from .kv_memory import run_child

    print(f"CPU: {cpu_model_name()}; {args.requests} requests (8-96 new tokens), {args.rows} rows")
    r = run_child("mlx_parallm_provider.bench.kv_churn", {k: v for k, v in vars(args).items() if k != "child"})
    for name in ("poisson", "burst"):
        s = r[f"{name}_steps"]
        ratio = s["churn_ms"] / s["quiet_ms"] if s["churn_ms"] and s["quiet_ms"] else float("nan")
        verdict = "met" if ratio <= CHURN_TARGET else "missed"
        print(f"{name}: {r[f'{name}_tok_s']:.1f} output tok/s; decode step at >= 3/4 batch: "
              f"{s['quiet_ms'] or 0:.1f} ms quiet ({s['quiet']} steps), {s['churn_ms'] or 0:.1f} ms with a join or leave "
              f"({s['churn']} steps): {ratio:.2f}x (target <= {CHURN_TARGET}x: {verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
