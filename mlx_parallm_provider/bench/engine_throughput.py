"""Engine throughput benchmark: aggregate output tokens/s at 1, 8 and 32 concurrent
requests through ``engine.generate``, next to mlx-lm's ``batch_generate`` and a bare
batched forward + argmax loop on the same prompts and weights, in one run; latency of one
request next to ``mlx_lm.generate``; and memory before, during and after.

Every request generates exactly ``--max-tokens`` tokens (EOS ignored everywhere), greedy.

    python -m mlx_parallm_provider.bench.engine_throughput [--model default] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import types
from typing import Any, Optional, Sequence

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis briefly.", "Write a haiku about rain.",
    "List three uses of copper.", "Why is the sky blue?", "What does a compiler do?",
    "Give me a tip for learning Python.", "Describe a cat in one sentence.", "What is 17 times 3?",
    "Name a famous painter and one painting.", "How do vaccines work?", "What is a prime number?",
    "Suggest a name for a bakery.", "What causes tides?", "Summarize the plot of Cinderella.",
    "What is the boiling point of water?",
]


def _prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (variant {i // len(QUESTIONS)})")
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def bare_loop(model: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """One left-padded prefill, then greedy steps over BatchKVCache. Returns (wall s, median step s)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    tic = time.perf_counter()
    longest = max(len(p) for p in prompts)
    padding = [longest - len(p) for p in prompts]
    cache = [BatchKVCache(padding) for _ in model.layers]
    x = mx.array([[0] * pad + p for pad, p in zip(padding, prompts)])
    token = mx.argmax(model(x, cache=cache)[:, -1, :], axis=-1)
    mx.eval(token)
    steps = []
    for _ in range(max_tokens - 1):
        t = time.perf_counter()
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
        token.tolist()
        steps.append(time.perf_counter() - t)
    return time.perf_counter() - tic, sorted(steps)[len(steps) // 2]


def mlx_lm_batch(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """mlx-lm's batch_generate on the same prompts (EOS disabled). Returns wall seconds."""
    from mlx_lm import batch_generate

    no_eos = types.SimpleNamespace(eos_token_ids=[], decode=tokenizer.decode)
    tic = time.perf_counter()
    batch_generate(model, no_eos, prompts, max_tokens=max_tokens)
    return time.perf_counter() - tic


def engine_run(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """All prompts through engine.generate at once. Returns (wall s, median decode step s)."""
    from ..engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.metrics.reset()

    async def main() -> list:
        return await asyncio.gather(*(engine.generate(p, params) for p in prompts))

    tic = time.perf_counter()
    outs = asyncio.run(main())
    wall = time.perf_counter() - tic
    assert all(o.usage.completion_tokens == max_tokens for o in outs)
    return wall, engine.stats()["step_s"]["p50"]


def single_latency(model: Any, tokenizer: Any, engine: Any, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """Seconds for one request: mlx_lm.generate vs engine.generate_sync."""
    import mlx_lm

    from ..engine.request import SamplingParams

    tic = time.perf_counter()
    n = 0
    for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        n += 1
    ref = time.perf_counter() - tic
    tic = time.perf_counter()
    engine.generate_sync(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    return ref, time.perf_counter() - tic


def run(model_name: str, max_tokens: int, concurrency: Sequence[int]) -> dict[str, Any]:
    import mlx.core as mx

    from ..engine.coordinator import Engine
    from ..models import backend, registry

    loaded = registry.load(model_name)
    model, tokenizer = loaded.model, loaded.tokenizer
    engine = Engine(model_name, loaded=loaded)
    mx.clear_cache()
    idle = mx.get_active_memory()
    mx.reset_peak_memory()
    rows = []
    for c in concurrency:
        prompts = _prompts(tokenizer, c)
        bare_wall, bare_step = bare_loop(model, prompts, max_tokens)
        ref_wall = mlx_lm_batch(model, tokenizer, prompts, max_tokens)
        eng_wall, eng_step = engine_run(engine, prompts, max_tokens)
        total = c * max_tokens
        rows.append({
            "concurrent": c,
            "engine_tok_s": total / eng_wall,
            "mlx_lm_batch_generate_tok_s": total / ref_wall,
            "bare_loop_tok_s": total / bare_wall,
            "engine_step_ms": eng_step * 1000,
            "bare_step_ms": bare_step * 1000,
        })
    peak = mx.get_peak_memory()
    time.sleep(0.2)
    mx.clear_cache()
    after = mx.get_active_memory()
    ref_1, eng_1 = single_latency(model, tokenizer, engine, _prompts(tokenizer, 1)[0], max_tokens)
    engine.shutdown()
    return {
        "model": model_name,
        "blas": backend.blas_in_use(),
        "max_tokens": max_tokens,
        "rows": rows,
        "single_request_s": {"mlx_lm_generate": ref_1, "engine": eng_1},
        "memory_mb": {"idle": idle / 2**20, "peak": peak / 2**20, "after": after / 2**20},
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        f"model={result['model']}  BLAS: {result['blas']}  {result['max_tokens']} new tokens per request (greedy, EOS ignored)",
        f"{'concurrent':>10} {'engine tok/s':>13} {'batch_generate':>15} {'bare loop':>10} {'engine/bg':>10} {'engine step ms':>15} {'bare step ms':>13} {'step overhead':>14}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['concurrent']:>10} {r['engine_tok_s']:>13.1f} {r['mlx_lm_batch_generate_tok_s']:>15.1f} {r['bare_loop_tok_s']:>10.1f} "
            f"{r['engine_tok_s'] / r['mlx_lm_batch_generate_tok_s']:>9.2f}x {r['engine_step_ms']:>15.1f} {r['bare_step_ms']:>13.1f} "
            f"{(r['engine_step_ms'] / r['bare_step_ms'] - 1) * 100:>13.1f}%"
        )
    s = result["single_request_s"]
    lines.append(
        f"one request: mlx_lm.generate {s['mlx_lm_generate']:.2f}s, engine {s['engine']:.2f}s "
        f"({(s['engine'] / s['mlx_lm_generate'] - 1) * 100:+.1f}%)"
    )
    m = result["memory_mb"]
    lines.append(f"MLX active memory: idle {m['idle']:.0f} MB, peak {m['peak']:.0f} MB, after {m['after']:.0f} MB")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--json", help="also write the result to this JSON file")
    args = parser.parse_args(argv)
    import mlx_parallm_provider  # noqa: F401  (BLAS preload before mlx)

    result = run(args.model, args.max_tokens, args.concurrency)
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
