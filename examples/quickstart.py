"""Load the embedded default model and answer a few questions.

Run: ./scripts/quickstart.sh   (or: python examples/quickstart.py)
"""

from __future__ import annotations

import time

import mlx_parallm_provider  # noqa: F401  (first: sets up the fast CPU BLAS before mlx loads)
import mlx_lm

from mlx_parallm_provider.models import registry

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
]


def main() -> None:
    tic = time.perf_counter()
    loaded = registry.load("default")
    print(f"loaded {loaded.path} in {time.perf_counter() - tic:.1f}s")
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        answer = mlx_lm.generate(loaded.model, loaded.tokenizer, prompt, max_tokens=48)
        print(f"Q: {question}\nA: {answer.strip()}\n")


if __name__ == "__main__":
    main()
