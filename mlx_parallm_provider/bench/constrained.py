"""Cost of constrained decoding inside the batch: the same concurrent requests with and
without a grammar, in one run, and the time spent filling and applying masks per step.

    python -m mlx_parallm_provider.bench.constrained [--model default] [--concurrency 32] [--max-tokens 48]

Three passes over the same prompts (greedy, EOS ignored so every row makes the same number
of tokens): unconstrained; a grammar that allows any text (pure overhead of the masks);
a JSON schema (compact JSON, rows stop when their object is complete, so the batch thins
out and tok/s falls for that reason too).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import mlx_parallm_provider  # noqa: F401  (BLAS before mlx)

from ..chat import prepare_chat
from ..engine import Constraint, Engine, SamplingParams
from ..engine import sampling as sampling_module

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer"},
                   "activities": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 5}},
    "required": ["city", "days", "activities"], "additionalProperties": False,
}


class MaskTimer:
    """Wraps the sampler's mask step and adds up its wall time and calls. (It evaluates the
    logits first, so the masks no longer overlap the model's compute while timed.)"""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._real = sampling_module.mask_logits

    def __call__(self, logits: Any, matchers: Any, tokenizer: Any) -> Any:
        import mlx.core as mx

        mx.eval(logits)  # the model's part of the step, outside the timer
        tic = time.perf_counter()
        out = self._real(logits, matchers, tokenizer)
        mx.eval(out)
        self.seconds += time.perf_counter() - tic
        self.calls += 1
        return out


async def _run(engine: Engine, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    tic = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    return time.perf_counter() - tic, sum(r.usage.completion_tokens for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    engine = Engine(args.model)
    prompts = [prepare_chat(engine.tokenizer, [{"role": "user", "content": f"Plan trip {i}: a city, days and activities, as JSON."}]).prompt
               for i in range(args.concurrency)]
    timer = MaskTimer()
    sampling_module.mask_logits = timer
    passes = {
        "unconstrained": SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
        "any-text grammar": SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, constraint=Constraint.regex(r"(.|\n)*")),
        "JSON schema": SamplingParams(max_tokens=args.max_tokens, constraint=Constraint.json_schema(SCHEMA)),
    }
    asyncio.run(_run(engine, prompts[:2], passes["JSON schema"]))  # warm-up: builds the grammar tokenizer
    print(f"| {args.concurrency} concurrent, max_tokens={args.max_tokens} | output tok/s | vs unconstrained | mask ms/step |")
    print("|---|---|---|---|")
    base = None
    for name, params in passes.items():
        timer.seconds, timer.calls = 0.0, 0
        wall, tokens = asyncio.run(_run(engine, prompts, params))
        rate = tokens / wall
        base = base or rate
        mask = f"{1000 * timer.seconds / timer.calls:.1f}" if timer.calls else "-"
        print(f"| {name} | {rate:.1f} | {rate / base:.2f}x | {mask} |")
    engine.shutdown()


if __name__ == "__main__":
    main()
