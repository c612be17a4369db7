"""Cost of constrained decoding inside the batch: the same concurrent requests with and
without a grammar, in one run, and the time spent filling and applying masks per step.

    python -m mlx_parallm_provider.bench.constrained [--model default] [--concurrency 32] [--max-tokens 48]

Passes over the same prompts, greedy, interleaved ``--repeats`` times (medians shown), then
one pass of each grammar timing its masks (the logits evaluated first, so the mask time is
the masks' own; the throughput passes keep the masks overlapped with the model's step):
unconstrained and a grammar that allows any text (pure overhead of the masks), both with
EOS ignored so every row makes ``--max-tokens`` tokens; a JSON schema, whose rows stop
when their object is complete, so the batch thins out; and its unconstrained twin, each
row decoding exactly as many tokens as its JSON twin did (EOS ignored), so it thins out
alike. The JSON pass is compared with its twin, the any-text pass with the first.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any, Optional

import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)

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
    """Wraps the sampler's mask steps (filling the masks: ``grammar_bitmask``; applying them:
    ``apply_bitmask``, which a step whose rows each allow one token skips). When ``timing``,
    it evaluates the step's logits first and then adds up the wall time of filling and
    applying the masks, so that time is the masks' alone (but no longer overlaps the model's
    compute): throughput passes run with ``timing`` off, and separate passes measure the mask
    time. :meth:`install` puts it in, :meth:`remove` takes it out."""

    def __init__(self) -> None:
        self.seconds, self.calls, self.timing = 0.0, 0, False
        self.real_fill, self.real_apply = sampling_module.grammar_bitmask, sampling_module.apply_bitmask

    def install(self) -> None:
        sampling_module.grammar_bitmask, sampling_module.apply_bitmask = self.fill, self.apply

    def remove(self) -> None:
        sampling_module.grammar_bitmask, sampling_module.apply_bitmask = self.real_fill, self.real_apply

    def fill(self, logits: Any, matchers: Any, tokenizer: Any) -> Any:
        if not self.timing:
            return self.real_fill(logits, matchers, tokenizer)
        import mlx.core as mx

        mx.eval(logits)  # the model's part of the step, outside the timer
        tic = time.perf_counter()
        out = self.real_fill(logits, matchers, tokenizer)
        self.seconds += time.perf_counter() - tic
        self.calls += 1
        return out

    def apply(self, logits: Any, bitmask: Any) -> Any:
        if not self.timing:
            return self.real_apply(logits, bitmask)
        import mlx.core as mx

        tic = time.perf_counter()
        out = self.real_apply(logits, bitmask)
        mx.eval(out)
        self.seconds += time.perf_counter() - tic
        return out


async def _run(engine: Engine, prompts: list[str], params: list[SamplingParams]) -> tuple[float, list[int]]:
    """Wall time and each row's output token count of one concurrent pass."""
    tic = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, params)))
    return time.perf_counter() - tic, [r.usage.completion_tokens for r in results]


class Pass:
    """One kind of pass: its tok/s and mask ms/step over the repeats."""

    def __init__(self, name: str) -> None:
        self.name, self.rates = name, []
        self.mask_ms: list[float] = []  # from the separate timed pass
        self.counts: list[list[int]] = []  # each repeat's output tokens per row

    def record(self, wall: float, counts: list[int]) -> None:
        self.counts.append(counts)
        self.rates.append(sum(counts) / wall)

    def row(self, base: "Pass") -> str:
        rate, ratio = statistics.median(self.rates), statistics.median(r / b for r, b in zip(self.rates, base.rates))
        mask = f"{statistics.median(self.mask_ms):.2f}" if self.mask_ms else "-"
        return f"| {self.name} | {rate:.1f} | {ratio:.2f}x ({base.name}) | {mask} |"


def measure(engine: Engine, prompts: list[str], max_tokens: int, repeats: int) -> dict[str, Pass]:
    """Run the passes (see the module docstring) ``repeats`` times, interleaved."""
    timer = MaskTimer()
    timer.install()
    try:
        n = len(prompts)
        free = [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * n
        any_text = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, constraint=Constraint.regex(r"(.|\n)*"))] * n
        schema = [SamplingParams(max_tokens=max_tokens, constraint=Constraint.json_schema(SCHEMA))] * n
        asyncio.run(_run(engine, prompts[:2], schema[:2]))  # warm-up: builds the grammar tokenizer
        passes = {k: Pass(k) for k in ("unconstrained", "any-text grammar", "JSON schema", "unconstrained twin")}
        for _ in range(repeats):
            for name, params in (("unconstrained", free), ("any-text grammar", any_text), ("JSON schema", schema)):
                wall, counts = asyncio.run(_run(engine, prompts, params))
                passes[name].record(wall, counts)
            # The JSON rows stop when their object is complete, so the batch thins out: the
            # twin decodes exactly as many tokens per row, unconstrained, and thins out alike.
            twin = [SamplingParams(max_tokens=c, ignore_eos=True) for c in counts]
            passes["unconstrained twin"].record(*asyncio.run(_run(engine, prompts, twin)))
        timer.timing = True
        for name, params in (("any-text grammar", any_text), ("JSON schema", schema)):
            timer.seconds, timer.calls = 0.0, 0
            asyncio.run(_run(engine, prompts, params))
            passes[name].mask_ms.append(1000 * timer.seconds / timer.calls)
        return passes
    finally:
        timer.remove()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2, help="each pass this many times, interleaved; medians shown")
    args = parser.parse_args(argv)
    engine = Engine(args.model)
    try:
        prompts = [prepare_chat(engine.tokenizer, [{"role": "user", "content": f"Plan trip {i}: a city, days and activities, as JSON."}]).prompt
                   for i in range(args.concurrency)]
        passes = measure(engine, prompts, args.max_tokens, args.repeats)
    finally:
        engine.shutdown()
    print(f"| {args.concurrency} concurrent, max_tokens={args.max_tokens}, medians of {args.repeats} | output tok/s | vs | mask ms/step |")
    print("|---|---|---|---|")
    base = passes["unconstrained"]
    for name in ("unconstrained", "any-text grammar", "unconstrained twin"):
        print(passes[name].row(base))
    print(passes["JSON schema"].row(passes["unconstrained twin"]))

if __name__ == "__main__":
    main()
