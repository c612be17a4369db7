"""What OpenAI's ``prediction`` buys with n-gram speculation, measured in one run.

    python -m mlx_parallm_provider.bench.prediction [--model default] [--functions 12]
        [--max-tokens 256] [--repeats 3]

One stream asked to rewrite a file of ``--functions`` small functions unchanged (the file is
in the prompt), greedy, EOS ignored, decoded four ways in turn each repeat: speculation off;
``speculative="ngram"`` without a prediction; with the file as the prediction; with the answer
itself (a perfect prediction: the first plain run's text). Every answer is checked equal to
the plain one; the table gives each way's median output tokens a second.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from typing import Optional

from ..config import EngineConfig
from ..cpu_info import cpu_model_name
from ..engine import Engine, SamplingParams


def measure(model: str, functions: int, max_tokens: int, repeats: int) -> list[tuple[str, str, float]]:
    """``(speculative, prediction, median tokens/s)`` of each way."""
    code = "".join(f"def f{i}(x, y):\n    total = x + y * {i}\n    return total\n\n\n" for i in range(functions))
    messages = [{"role": "user", "content": f"Here is a file:\n```python\n{code}```\nRewrite the whole file, unchanged."}]
    engines = {"off": Engine(model, EngineConfig()), "ngram": Engine(model, EngineConfig(speculative="ngram"))}
    try:
        prompt = engines["off"].tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        params = {"max_tokens": max_tokens, "ignore_eos": True}
        plain = engines["off"].generate_sync(prompt, SamplingParams(**params)).text
        ways: list[tuple[str, str, Optional[str]]] = [("off", "none", None), ("ngram", "none", None), ("ngram", "the file", code),
                                                     ("ngram", "the answer itself", plain)]
        seconds: list[list[float]] = [[] for _ in ways]
        for _ in range(repeats):
            for i, (name, _, prediction) in enumerate(ways):
                tic = time.perf_counter()
                out = engines[name].generate_sync(prompt, SamplingParams(**params, prediction=prediction))
                seconds[i].append(time.perf_counter() - tic)
                if out.text != plain:
                    raise AssertionError(f"{name} with {ways[i][1]!r} answered differently")
        return [(name, label, max_tokens / statistics.median(s)) for (name, label, _), s in zip(ways, seconds)]
    finally:
        for engine in engines.values():
            engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--functions", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = measure(args.model, args.functions, args.max_tokens, args.repeats)
    print(f"{datetime.date.today()}, {cpu_model_name()}, model {args.model}, {args.max_tokens} tokens, medians of {args.repeats}")
    print("| speculative | prediction | tok/s | vs off |\n|---|---|---|---|")
    for name, label, rate in rows:
        print(f"| {name} | {label} | {rate:.1f} | {rate / rows[0][2]:.2f}x |")


if __name__ == "__main__":
    main()
