"""What ``kv_cache_dtype`` int8 / int4 buys against float16, measured in one run.

    python -m mlx_parallm_provider.bench.kv_dtype [--model default] [--text-tokens 2048]
        [--rows 32] [--context 2048] [--repeats 5] [--budget-gb 0.03]

1. **bytes per token**: an engine per dtype, one request served; its ``stats()["kv_cache"]``
   bytes over the slots the arrays hold, and the engine's own figure (what the budget counts);
2. **numerics**: teacher-forced over ``--text-tokens`` tokens of English text (Python's
   module docstrings, as :mod:`.int8_numerics` scores), fed in prefill pieces through paged
   KV of each dtype at once: every position's next-token distribution against float16's
   (the share whose most likely token is float16's, the mean KL(float16 || dtype));
3. **decode step time**: ``--rows`` rows of ``--context`` tokens each in KV blocks of each
   dtype (one prompt prefilled, its blocks copied into every row), one decode step over them
   (the model's forward and argmax; every dtype runs the fused decoder-layer op, the
   quantized pools' writes quantized in it and the paged kernel reading their codes), and the attention of
   every layer alone; the dtypes alternate each repeat; medians and their ratios to float16;
4. **rows held under one budget**: an engine per dtype with ``kv_cache_memory_gb=--budget-gb``
   serves ``--requests`` requests of ``--prompt-tokens`` + ``--new-tokens`` at once: the
   largest decode batch it ran, preemptions and failures.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import statistics
import time
from typing import Any, Optional, Sequence

from ..cpu_info import cpu_model_name

DTYPES = ("float16", "int8", "int4")
BLOCK_SIZE = 16


def _storage(model: Any, dtype: str, blocks: int) -> Any:
    """Paged KV arrays of ``dtype`` for ``blocks`` blocks (all allocated now)."""
    import mlx.core as mx

    from ..engine.kv.storage import QUANTIZED_KV_BITS, PagedKVStorage

    bits = QUANTIZED_KV_BITS.get(dtype)
    return PagedKVStorage(len(model.layers), blocks, BLOCK_SIZE, preallocate=True, dtype=None if bits else getattr(mx, dtype), bits=bits)


def bytes_per_token(model_name: str, loaded: Any) -> dict[str, dict[str, float]]:
    """Per dtype: the pool's bytes over the slots its arrays hold (after one request), and
    the engine's bytes per token (what a budget is divided by)."""
    from ..config import EngineConfig
    from ..engine import Engine, SamplingParams

    out = {}
    for dtype in DTYPES:
        engine = Engine(model_name, EngineConfig(kv_cache_dtype=dtype), loaded=loaded)
        try:
            engine.generate_sync("How many bytes does a token take?", SamplingParams(max_tokens=4))
            kv = engine.stats()["kv_cache"]
            storage = engine._core.memory.storage  # noqa: SLF001 (the slots the arrays hold)
            slots = storage.physical_blocks * storage.block_size
            out[dtype] = {"stats_bytes_per_token": kv["kv_cache_bytes"] / slots, "engine_bytes_per_token": engine._kv_bytes_per_token}  # noqa: SLF001
        finally:
            engine.shutdown()
    return out


def text_tokens(tokenizer: Any, count: int) -> list[int]:
    """The first ``count`` tokens of :mod:`.int8_numerics`' texts, one after another."""
    from .int8_numerics import texts

    ids: list[int] = []
    for text in texts():
        ids.extend(tokenizer.encode(text))
        if len(ids) >= count:
            break
    if len(ids) < count:
        raise SystemExit(f"the texts hold {len(ids)} tokens, fewer than {count}")
    return ids[:count]


def numerics(model: Any, tokens: list[int], piece: int = 256) -> dict[str, dict[str, float]]:
    """Teacher-forced over ``tokens`` (prefill pieces of ``piece`` through paged KV of each
    dtype): per quantized dtype, the share of positions whose most likely next token is
    float16's and the mean KL(float16 || dtype) of the next-token distributions."""
    import mlx.core as mx

    from ..engine.kv.paged_cache import PagedBatch

    blocks = -(-len(tokens) // BLOCK_SIZE) + 1
    table = list(range(1, blocks))  # block 0: the null block
    pools = {dtype: _storage(model, dtype, blocks) for dtype in DTYPES}
    sums = {dtype: {"same_top1": 0.0, "kld": 0.0} for dtype in DTYPES[1:]}
    positions = len(tokens) - 1
    for start in range(0, positions, piece):
        ids = tokens[start : min(start + piece, positions)]
        logprobs = {}
        for dtype, storage in pools.items():
            batch = PagedBatch(storage, [table], [start], [len(ids)], len(ids))
            logits = model(mx.array([ids]), cache=batch.layers())[0].astype(mx.float32)
            logprobs[dtype] = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            mx.eval(logprobs[dtype], storage.arrays())
        ref = logprobs["float16"]
        for dtype in sums:
            got = logprobs[dtype]
            sums[dtype]["kld"] += (mx.exp(ref) * (ref - got)).sum().item()
            sums[dtype]["same_top1"] += (mx.argmax(got, axis=-1) == mx.argmax(ref, axis=-1)).sum().item()
    return {dtype: {k: v / positions for k, v in s.items()} | {"positions": positions} for dtype, s in sums.items()}


class _Rows:
    """``rows`` rows of ``context`` tokens each in KV blocks of ``dtype`` (one prompt
    prefilled, its blocks copied into every row) and one decode pass over them at position
    ``context`` (each pass writes that slot again: no row grows)."""

    def __init__(self, model: Any, dtype: str, rows: int, context: int, prompt: Any) -> None:
        import mlx.core as mx

        from ..engine.kv.paged_cache import PagedBatch

        per_row = -(-(context + 1) // BLOCK_SIZE)
        self.storage = _storage(model, dtype, rows * per_row + 1)
        self.tables = [list(range(1 + b * per_row, 1 + (b + 1) * per_row)) for b in range(rows)]
        self.rows, self.context = rows, context
        for start in range(0, context, 512):  # (pieces: a 2,048-token piece's scores alone are ~1 GB)
            ids = prompt[:, start : start + 512]
            model(ids, cache=PagedBatch(self.storage, self.tables[:1], [start], [ids.shape[1]], ids.shape[1]).layers())
            mx.eval(self.storage.arrays())
        self.storage.copy_blocks([(self.tables[0][i], table[i]) for table in self.tables[1:] for i in range(per_row)])
        mx.eval(self.storage.arrays())

    def layers(self) -> list[Any]:
        from ..engine.kv.paged_cache import PagedBatch

        return PagedBatch(self.storage, self.tables, [self.context] * self.rows, [1] * self.rows, 1).layers()


def step_times(model: Any, rows: int, context: int, repeats: int) -> dict[str, dict[str, float]]:
    """Per dtype, the median wall-clock ms of a decode step over ``rows`` rows of ``context``
    tokens and of every layer's attention alone (the dtypes alternating each repeat, one
    warm-up each)."""
    import mlx.core as mx

    from ..models import backends

    ops = backends.of(model) or backends.MLXOps()
    prompt = mx.random.randint(0, 1000, (1, context), key=mx.random.key(0))
    states = {dtype: _Rows(model, dtype, rows, context, prompt) for dtype in DTYPES}
    a0 = model.layers[0].self_attn
    q = mx.random.normal((rows, a0.n_heads, 1, a0.head_dim), key=mx.random.key(2))
    kv = mx.random.normal((rows, a0.n_kv_heads, 1, a0.head_dim), key=mx.random.key(3))
    tokens = mx.random.randint(0, 1000, (rows, 1), key=mx.random.key(1))
    mx.eval(q, kv, tokens)

    def step(state: _Rows) -> float:
        tic = time.perf_counter()
        mx.eval(mx.argmax(model(tokens, cache=state.layers())[:, -1], axis=-1), state.storage.arrays())
        return 1000 * (time.perf_counter() - tic)

    def attention(state: _Rows) -> float:
        caches = state.layers()
        tic = time.perf_counter()
        mx.eval([c.attend(q, kv, kv, layer.self_attn.scale, None, backend=ops) for c, layer in zip(caches, model.layers)])
        return 1000 * (time.perf_counter() - tic)

    times: dict[str, dict[str, list[float]]] = {d: {"step": [], "attention": []} for d in DTYPES}
    for dtype in DTYPES:  # warm-up
        step(states[dtype]), attention(states[dtype])
    for _ in range(repeats):
        for dtype in DTYPES:
            times[dtype]["step"].append(step(states[dtype]))
            times[dtype]["attention"].append(attention(states[dtype]))
    return {d: {f"{k}_ms": statistics.median(v) for k, v in t.items()} | {"step_ms_all": t["step"]} for d, t in times.items()}


def rows_held(model_name: str, loaded: Any, budget_gb: float, requests: int, prompt_tokens: int, new_tokens: int) -> dict[str, dict[str, Any]]:
    """Per dtype, an engine with ``kv_cache_memory_gb=budget_gb`` serving ``requests`` requests
    of ``prompt_tokens`` + ``new_tokens`` at once: its largest decode batch, blocks,
    preemptions and failures."""
    from ..config import EngineConfig
    from ..engine import Engine, SamplingParams

    prompts = [[100 + (7 * i + j) % 5000 for j in range(prompt_tokens)] for i in range(requests)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    out = {}
    for dtype in DTYPES:
        engine = Engine(model_name, EngineConfig(kv_cache_dtype=dtype, kv_cache_memory_gb=budget_gb, max_num_seqs=max(64, requests),
                                                 enable_prefix_caching=False), loaded=loaded)
        failed: list[str] = []

        async def one(prompt: list[int]) -> None:
            try:
                await engine.generate(prompt, params)
            except Exception as exc:  # counted: the target is none
                failed.append(f"{type(exc).__name__}: {exc}")

        async def run() -> None:
            await asyncio.gather(*(one(p) for p in prompts))

        try:
            tic = time.perf_counter()
            asyncio.run(run())
            stats = engine.stats()
            kv = stats["kv_cache"]
            out[dtype] = {"max_batch": stats["max_batch_size"], "blocks": kv["kv_blocks_total"], "preemptions": kv["num_preemptions"],
                          "failed": len(failed), "first_failure": failed[0] if failed else None, "wall_s": time.perf_counter() - tic}
        finally:
            engine.shutdown()
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--text-tokens", type=int, default=2048, help="tokens scored teacher-forced (2)")
    ap.add_argument("--rows", type=int, default=32, help="rows of a decode step (3)")
    ap.add_argument("--context", type=int, default=2048, help="tokens each row holds (3)")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per dtype (3)")
    ap.add_argument("--budget-gb", type=float, default=0.03, help="kv_cache_memory_gb of (4)")
    ap.add_argument("--requests", type=int, default=24, help="requests at once (4)")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="each request's prompt (4)")
    ap.add_argument("--new-tokens", type=int, default=16, help="each request's new tokens (4)")
    ap.add_argument("--skip", default="", help="comma-separated parts not to run: bytes,numerics,steps,rows")
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)

    from ..models import backends, registry

    loaded = registry.load(args.model)
    model = loaded.model
    backend = backends.of(model)
    print(f"{datetime.date.today()} · CPU: {cpu_model_name()}; {os.cpu_count()} CPUs · model {args.model} · backend "
          f"{getattr(backend, 'name', None)}")
    if "bytes" not in skip:
        print("\n## KV bytes per token\n\n| dtype | stats bytes / slot | engine bytes / token | vs float16 |\n|---|---:|---:|---:|")
        b = bytes_per_token(args.model, loaded)
        for dtype, r in b.items():
            print(f"| {dtype} | {r['stats_bytes_per_token']:.0f} | {r['engine_bytes_per_token']} | "
                  f"{b['float16']['stats_bytes_per_token'] / r['stats_bytes_per_token']:.2f}x fewer |")
    if "numerics" not in skip:
        n = numerics(model, text_tokens(loaded.tokenizer, args.text_tokens))
        print(f"\n## Numerics vs float16 KV ({next(iter(n.values()))['positions']} positions teacher-forced)\n\n"
              "| dtype | same top token | mean KL(float16 || dtype) |\n|---|---:|---:|")
        for dtype, r in n.items():
            print(f"| {dtype} | {100 * r['same_top1']:.2f}% | {r['kld']:.6f} |")
    if "steps" not in skip:
        t = step_times(model, args.rows, args.context, args.repeats)
        print(f"\n## Decode step, {args.rows} rows x {args.context} tokens of context (medians of {args.repeats}, dtypes alternating)\n\n"
              "| dtype | step ms | vs float16 | attention ms (all layers) | vs float16 |\n|---|---:|---:|---:|---:|")
        for dtype, r in t.items():
            print(f"| {dtype} | {r['step_ms']:.1f} | {r['step_ms'] / t['float16']['step_ms']:.2f}x | {r['attention_ms']:.1f} | "
                  f"{r['attention_ms'] / t['float16']['attention_ms']:.2f}x |")
        print("step ms, every repeat: " + "; ".join(f"{d} {', '.join(f'{x:.0f}' for x in r['step_ms_all'])}" for d, r in t.items()))
    if "rows" not in skip:
        h = rows_held(args.model, loaded, args.budget_gb, args.requests, args.prompt_tokens, args.new_tokens)
        print(f"\n## Rows held under kv_cache_memory_gb={args.budget_gb} ({args.requests} requests of {args.prompt_tokens} + "
              f"{args.new_tokens} tokens at once)\n\n| dtype | blocks | largest decode batch | vs float16 | preemptions | failed |\n"
              "|---|---:|---:|---:|---:|---:|")
        for dtype, r in h.items():
            ratio = r["max_batch"] / h["float16"]["max_batch"] if h["float16"]["max_batch"] else math.nan
            print(f"| {dtype} | {r['blocks']} | {r['max_batch']} | {ratio:.2f}x | {r['preemptions']} | {r['failed']} |")
            if r["first_failure"]:
                print(f"  first failure: {r['first_failure']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
