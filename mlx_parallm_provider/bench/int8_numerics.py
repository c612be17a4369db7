"""What the int8 path does to a model's numbers: the CPU kernels' float32 path and their int8
path (activations quantized per row in blocks of 32, integer dot products) against mlx-lm
running the same checkpoint's weights dequantized to float32, in one process.

As llama.cpp's ``perplexity --kl-divergence`` reports a quantization: teacher-forced over
fixed English texts (Python's own module docstrings, so every machine scores the same
tokens), each path's perplexity, the mean KL divergence of its next-token distribution from
the reference's and how often its most likely token is the reference's; then greedy answers
to the chat workload's prompts, how many tokens each path keeps the reference's before it
first leaves them.

    python -m mlx_parallm_provider.bench.int8_numerics [--model default] [--tokens 512]
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
from typing import Any, Callable, Optional, Sequence

TEXT_MODULES = ("argparse", "json", "csv", "timeit", "unittest", "heapq", "sched", "doctest", "inspect", "ftplib")
"""Modules whose docstrings are the scored text (English prose about code, stdlib only)."""


PATHS = {"float32": 0, "int16": 16, "int8": 8}
"""The paths compared: activations in float32 (the float kernels), or quantized in blocks of
32 to 16 bits (two int8 planes; CPUs with AVX-512 VNNI) or to int8."""


def texts() -> list[str]:
    """The scored texts: :data:`TEXT_MODULES`' docstrings."""
    return [importlib.import_module(name).__doc__ or "" for name in TEXT_MODULES]


def _log_softmax(logits: Any) -> Any:
    import mlx.core as mx

    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def teacher_forced(forward: Callable[[Any], Any], reference: Callable[[Any], Any], token_lists: Sequence[list[int]]) -> dict[str, float]:
    """Perplexity of ``forward`` over ``token_lists``, and against ``reference``: the mean KL
    divergence (reference || forward) per position and the share of positions whose most
    likely next token is the reference's."""
    import mlx.core as mx

    nll = kld = same = positions = 0.0
    for ids in token_lists:
        x = mx.array(ids)[None]
        got, ref = _log_softmax(forward(x)[0, :-1]), _log_softmax(reference(x)[0, :-1])
        targets = mx.array(ids[1:])
        nll += -mx.take_along_axis(got, targets[:, None], axis=-1).sum().item()
        kld += (mx.exp(ref) * (ref - got)).sum().item()
        same += (mx.argmax(got, axis=-1) == mx.argmax(ref, axis=-1)).sum().item()
        positions += len(ids) - 1
    return {"perplexity": math.exp(nll / positions), "kld": kld / positions, "same_top1": same / positions, "positions": positions}


def greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """``max_tokens`` greedy tokens after ``prompt`` (EOS not special), with mlx-lm's cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)
    out = []
    for _ in range(max_tokens):
        token = mx.argmax(logits[0, -1]).item()
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return out


def kept(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens equal the reference's."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def run(model_name: str = "default", max_text_tokens: int = 512, prompts: int = 8, max_tokens: int = 64) -> dict[str, Any]:
    """The figures for the engine's float32 and int8 paths against mlx-lm (float32 weights)."""
    import mlx_parallm_provider.models  # noqa: F401  (OpenBLAS before mlx)

    from ..models import backends, registry
    from . import workloads

    served = registry.load(model_name)
    plain = registry.load(model_name, engine=False)
    backend = backends.of(served.model)
    if backend is None or not hasattr(backend, "int8_matmul"):
        raise SystemExit("the CPU kernels are not this model's backend (no compiler, or not the CPU device)")
    tokenizer = served.tokenizer
    token_lists = [ids[:max_text_tokens] for ids in (tokenizer.encode(t) for t in texts()) if len(ids) > 1]
    questions = [tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True)
                 for r in workloads.chat(prompts, max_tokens)]
    reference_answers = [greedy(plain.model, q, max_tokens) for q in questions]
    result: dict[str, Any] = {"model": model_name, "texts": len(token_lists), "prompts": prompts, "max_tokens": max_tokens, "paths": {}}
    before = backend.int8_matmul, backend.activation_bits
    try:
        for path, bits in PATHS.items():
            backend.int8_matmul, backend.activation_bits = bits > 0, bits or before[1]
            scores = teacher_forced(served.model, plain.model, token_lists)
            answers = [greedy(served.model, q, max_tokens) for q in questions]
            lengths = [kept(a, r) for a, r in zip(answers, reference_answers)]
            scores.update(identical_answers=sum(n == max_tokens for n in lengths), mean_tokens_kept=sum(lengths) / len(lengths))
            result["paths"][path] = scores
    finally:
        backend.int8_matmul, backend.activation_bits = before
    reference = teacher_forced(plain.model, plain.model, token_lists)
    result["paths"]["mlx-lm"] = {"perplexity": reference["perplexity"]}
    return result


def report(result: dict[str, Any]) -> str:
    """A markdown table of :func:`run`'s figures."""
    lines = [
        f"model {result['model']}: {result['texts']} texts teacher-forced, {result['prompts']} greedy answers of "
        f"{result['max_tokens']} tokens; reference: mlx-lm, float32 weights",
        "",
        "| path | perplexity | mean KLD | same top token | answers identical | mean tokens kept |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    paths = result["paths"]
    lines.append(f"| mlx-lm (reference) | {paths['mlx-lm']['perplexity']:.4f} | 0 | 100% | all | all |")
    for name in PATHS:
        if name not in paths:
            continue
        p = paths[name]
        lines.append(f"| {name} | {p['perplexity']:.4f} | {p['kld']:.6f} | {100 * p['same_top1']:.2f}% | "
                     f"{p['identical_answers']} / {result['prompts']} | {p['mean_tokens_kept']:.1f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=512, help="tokens scored of each text (its first ones)")
    parser.add_argument("--prompts", type=int, default=8, help="chat prompts answered greedily")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    result = run(args.model, args.tokens, args.prompts, args.max_tokens)
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
