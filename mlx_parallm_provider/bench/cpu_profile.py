"""Per-op profile of one decode step on the CPU: where the time of a step goes, by op family,
at several batch sizes and context lengths (each row's context in KV blocks, as the engine
holds it), with the CPU work off ("before", MLX's own ops)
and on ("after": :mod:`~mlx_parallm_provider.models.cpu_ops`, the extension's decode attention
and fused RMSNorm / RoPE and, for steps of a few rows,
:mod:`~mlx_parallm_provider.models.small_batch`'s packed-weight kernel), interleaved in one
process.

Each op family is timed alone at the step's real shapes, for every layer, as one evaluated
graph (the best of ``--repeats``). Times are the process's CPU time with one OpenBLAS
thread, one decode-attention thread and one packed-matmul thread (set in a child process): on a shared machine
wall-clock times swing several-fold from run to run while this stays within a few percent
(``--wall`` times wall-clock with the default threads instead). "full step" is the model's forward plus the greedy argmax;
"other" is the full step less the parts (op dispatch and what the parts miss). "worker
bookkeeping" is the engine worker's per-step Python work after sampling (detokenising,
stop strings, delivery), measured on a real engine run of ``batch`` requests.

    python -m mlx_parallm_provider.bench.cpu_profile [--batch 1 32 64] [--context 128 512]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

from ..config import child_environment

FAMILIES = ("attention", "kv cache update", "q/k/v/o matmuls", "MLP matmuls", "elementwise (norm, rope, silu-gate, add)",
            "lm_head (+ final norm)", "sampling (argmax, tolist)")


_clock = time.process_time


def _optimised(model: Any, on: bool, own: Any) -> None:
    """The model's CPU work on (True: ``own``, its backend) or off (False: MLX's own ops,
    float32 GEMMs)."""
    from ..models import backends

    backends.install(model, own if on else backends.MLXOps())


def _best(fn: Callable[[], Any], repeats: int) -> float:
    import mlx.core as mx

    mx.eval(fn())  # warm up (and compile)
    best = float("inf")
    for _ in range(repeats):
        tic = _clock()
        mx.eval(fn())
        best = min(best, _clock() - tic)
    return best * 1000


BLOCK_SIZE = 16


class _PagedRows:
    """``batch`` rows of ``context`` tokens each in KV blocks, as the engine holds them (a
    pool, a block table per row; the same prompt prefilled once, its blocks copied into every
    row's own), and the cache objects of one decode pass over them at position ``context``
    (each pass writes that slot again: no row grows)."""

    def __init__(self, model: Any, batch: int, context: int) -> None:
        import mlx.core as mx

        from ..engine.kv.paged_cache import PagedBatch
        from ..engine.kv.storage import PagedKVStorage

        per_row = -(-(context + 1) // BLOCK_SIZE)
        self.storage = PagedKVStorage(len(model.layers), batch * per_row + 1, BLOCK_SIZE, preallocate=True)
        self.tables = [list(range(1 + b * per_row, 1 + (b + 1) * per_row)) for b in range(batch)]  # block 0: the null block
        self.batch, self.context = batch, context
        prompt = mx.random.randint(0, 1000, (1, context), key=mx.random.key(0))
        model(prompt, cache=PagedBatch(self.storage, self.tables[:1], [0], [context], context).layers())
        self.storage.copy_blocks([(self.tables[0][i], table[i]) for table in self.tables[1:] for i in range(per_row)])
        mx.eval(self.storage.arrays())

    def step(self) -> list[Any]:
        """The layers' caches of one decode pass (a new token at position ``context`` a row)."""
        from ..engine.kv.paged_cache import PagedBatch

        return PagedBatch(self.storage, self.tables, [self.context] * self.batch, [1] * self.batch, 1).layers()


def _families(model: Any, rows: _PagedRows, batch: int) -> dict[str, Callable[[], Any]]:
    """One closure per op family, computing that family for every layer at the step's shapes."""
    import mlx.core as mx

    from ..models import backends

    ops = backends.of(model) or backends.MLXOps()
    layers = model.layers
    a0 = layers[0].self_attn
    hidden = model.args.hidden_size
    heads, kv_heads, head_dim = a0.n_heads, a0.n_kv_heads, a0.head_dim
    x = mx.random.normal((batch, 1, hidden), key=mx.random.key(1))
    q = mx.random.normal((batch, heads, 1, head_dim), key=mx.random.key(2))
    kv = mx.random.normal((batch, kv_heads, 1, head_dim), key=mx.random.key(3))
    inter = model.args.intermediate_size
    gate = mx.random.normal((batch, 1, inter), key=mx.random.key(4))
    mx.eval(x, q, kv, gate)

    def fresh(a: Any) -> Any:
        # A new array each repeat: layers sharing an input (small_batch.SharedInput) cache their
        # output by the input's identity, and would otherwise skip the work after the first.
        out = a + 0
        mx.eval(out)
        return out

    def attention() -> Any:  # through the block tables, as the engine's decode step attends
        return [c.attend(q, kv, kv, l.self_attn.scale, None, backend=ops) for c, l in zip(rows.step(), layers)]

    def kv_update() -> Any:
        return [c.update_and_fetch(kv, kv) for c in rows.step()]

    def elementwise() -> Any:
        out = []
        for layer, c in zip(layers, rows.step()):
            a = layer.self_attn
            h = x + layer.input_layernorm(x)
            out += [a.rope(q, offset=c.offset), a.rope(kv, offset=c.offset)]
            out.append(h + layer.post_attention_layernorm(h))
            out.append(ops.swiglu(gate, gate))
        return out

    def lm_head() -> Any:
        h = model.model.norm(fresh(x))
        return model.model.embed_tokens.as_linear(h) if model.args.tie_word_embeddings else model.lm_head(h)

    logits = mx.random.normal((batch, model.args.vocab_size), key=mx.random.key(5))
    mx.eval(logits)

    return {
        "attention": attention,
        "kv cache update": kv_update,
        "q/k/v/o matmuls": lambda: [p(xi) for xi in [fresh(x)] for l in layers
                                    for p in (l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj, l.self_attn.o_proj)],
        "MLP matmuls": lambda: [p(v) for xi, gi in [(fresh(x), fresh(gate))] for l in layers
                                for p, v in ((l.mlp.gate_proj, xi), (l.mlp.up_proj, xi), (l.mlp.down_proj, gi))],
        "elementwise (norm, rope, silu-gate, add)": elementwise,
        "lm_head (+ final norm)": lm_head,
        "sampling (argmax, tolist)": lambda: mx.array(mx.argmax(logits, axis=-1).tolist()),
    }


def _full_step(model: Any, rows: _PagedRows, batch: int) -> Callable[[], Any]:
    import mlx.core as mx

    tokens = mx.zeros((batch, 1), dtype=mx.int32)

    def step() -> Any:
        token = mx.argmax(model(tokens, cache=rows.step())[:, -1, :], axis=-1)
        mx.eval(token)
        return token

    return step


def decode_step_ms(model: Any, batch: int, contexts: Sequence[int], repeats: int) -> dict[int, float]:
    """Wall-clock milliseconds of one decode step (forward + argmax) of ``batch`` rows at each
    context length, the contexts interleaved, best of ``repeats``."""
    steps = {c: _full_step(model, _PagedRows(model, batch, c), batch) for c in contexts}
    best = {c: float("inf") for c in contexts}
    for _ in range(repeats):
        for c, step in steps.items():
            start = time.perf_counter()
            step()
            best[c] = min(best[c], time.perf_counter() - start)
    return {c: v * 1000 for c, v in best.items()}


def profile(model_name: str, batches: Sequence[int], contexts: Sequence[int], repeats: int) -> list[dict[str, Any]]:
    """Rows of ``{batch, context, op, before_ms, after_ms}``, the CPU work off and on interleaved."""
    from ..models import backends, registry

    model = registry.load(model_name).model
    own = backends.of(model)
    rows = []
    for batch in batches:
        for context in contexts:
            rows_kv = _PagedRows(model, batch, context)
            timings: dict[str, dict[bool, float]] = {}
            for _ in range(2):  # two rounds, each off then on: noise hits both columns alike
                for on in (False, True):
                    _optimised(model, on, own)
                    named = {**_families(model, rows_kv, batch), "full step": _full_step(model, rows_kv, batch)}
                    for name, fn in named.items():
                        t = _best(fn, repeats)
                        timings.setdefault(name, {})[on] = min(t, timings.get(name, {}).get(on, float("inf")))
            _optimised(model, True, own)
            for on in (False, True):
                parts = sum(timings[f][on] for f in FAMILIES)
                timings.setdefault("other (dispatch, glue)", {})[on] = timings["full step"][on] - parts
            for name, t in timings.items():
                rows.append({"batch": batch, "context": context, "op": name, "before_ms": t[False], "after_ms": t[True]})
    return rows


def prefill(model_name: str, prompt_len: int, repeats: int) -> dict[bool, float]:
    """Prefill tok/s of one ``prompt_len``-token prompt into a fresh cache, CPU work off / on."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from ..models import backends, registry

    model = registry.load(model_name).model
    own = backends.of(model)
    tokens = mx.random.randint(0, 1000, (1, prompt_len), key=mx.random.key(7))

    def run() -> Any:
        cache = [BatchKVCache([0]) for _ in model.layers]
        return model(tokens, cache=cache)[:, -1, :]

    best = {}
    for _ in range(2):
        for on in (False, True):
            _optimised(model, on, own)
            best[on] = min(best.get(on, float("inf")), _best(run, max(1, repeats // 2)))
    _optimised(model, True, own)
    return {on: prompt_len / (ms / 1000) for on, ms in best.items()}


def bookkeeping(model_name: str, batches: Sequence[int], max_tokens: int = 24) -> dict[int, dict[str, float]]:
    """Per decode step of a real engine run: ms in the runner's decode (forward + sampling)
    and in the scheduler's bookkeeping after it (``update``), for ``batch`` concurrent requests."""
    import asyncio

    from .. import EngineConfig, SamplingParams, get_engine, shutdown_engines
    from ..engine.runner import ModelRunner
    from ..engine.scheduler import Scheduler

    spent = {"decode": 0.0, "after": 0.0, "steps": 0}
    original_decode, original_update = ModelRunner._decode, Scheduler.update

    def timed_decode(self: ModelRunner, plan: Any, rows: Any, out: Any) -> None:
        tic = time.perf_counter()
        original_decode(self, plan, rows, out)
        spent["decode"] += time.perf_counter() - tic
        spent["steps"] += 1

    def timed_update(self: Scheduler, plan: Any, out: Any) -> Any:
        tic = time.thread_time()  # this thread's CPU: other threads' waits do not count
        results = original_update(self, plan, out)
        spent["after"] += time.thread_time() - tic
        return results

    out = {}
    ModelRunner._decode, Scheduler.update = timed_decode, timed_update  # type: ignore[method-assign]
    try:
        for batch in batches:
            shutdown_engines()
            engine = get_engine(model_name, EngineConfig(max_num_seqs=max(batch, 1)))
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

            async def burst() -> None:
                await asyncio.gather(*(engine.generate(f"Tell me fact number {i} about the sea.", params) for i in range(batch)))

            asyncio.run(burst())  # warm-up
            spent.update(decode=0.0, after=0.0, steps=0)
            asyncio.run(burst())
            steps = max(1, spent["steps"])
            out[batch] = {"decode_ms": spent["decode"] * 1000 / steps, "bookkeeping_ms": spent["after"] * 1000 / steps}
    finally:
        ModelRunner._decode, Scheduler.update = original_decode, original_update  # type: ignore[method-assign]
        shutdown_engines()
    return out


def report(rows: list[dict[str, Any]], books: Optional[dict[int, dict[str, float]]] = None,
           prefill_tok_s: Optional[dict[Any, float]] = None) -> str:
    """A markdown table per (batch, context): ms per decode step by op family, before/after."""
    lines = []
    if prefill_tok_s:
        before, after = prefill_tok_s.get(False) or prefill_tok_s.get("false"), prefill_tok_s.get(True) or prefill_tok_s.get("true")
        lines.append(f"prefill of a 512-token prompt, batch 1: {before:.0f} tok/s before, {after:.0f} tok/s after ({after / before:.2f}x)")
    keys = sorted({(r["batch"], r["context"]) for r in rows})
    for batch, context in keys:
        lines += [f"\nbatch {batch}, context {context} (ms per decode step, all layers)", "",
                  "| op | before | after | speed-up |", "|---|---:|---:|---:|"]
        for r in (r for r in rows if (r["batch"], r["context"]) == (batch, context)):
            ratio = f"{r['before_ms'] / r['after_ms']:.2f}x" if min(r["before_ms"], r["after_ms"]) > 0 else ""
            lines.append(f"| {r['op']} | {r['before_ms']:.2f} | {r['after_ms']:.2f} | {ratio} |")
        if books and batch in books:
            b = books[batch]
            lines.append(f"| worker bookkeeping (engine run, after) | | {b['bookkeeping_ms']:.2f} | |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-engine", action="store_true", help="skip the engine run (worker bookkeeping row)")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill row")
    parser.add_argument("--wall", action="store_true", help="time wall-clock with the default BLAS threads")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.child:  # OpenBLAS reads its thread count when loaded: set it in a child
        env = child_environment(**({} if args.wall else {"OPENBLAS_NUM_THREADS": "1", "MLX_PARALLM_ATTENTION_THREADS": "1",
                                                          "MLX_PARALLM_QMATMUL_THREADS": "1"}))
        cmd = [sys.executable, "-m", "mlx_parallm_provider.bench.cpu_profile", "--child", *(argv if argv is not None else sys.argv[1:])]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"profile child failed:\n{out.stderr}")
        rows, books, pre = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
        print(report(rows, {int(k): v for k, v in (books or {}).items()}, pre))
        return 0
    global _clock
    if args.wall:
        _clock = time.perf_counter
    rows = profile(args.model, args.batch, args.context, args.repeats)
    books = None if args.no_engine else bookkeeping(args.model, args.batch)
    pre = None if args.no_prefill else prefill(args.model, 512, args.repeats)
    print("RESULT " + json.dumps([rows, books, pre]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
