"""The GPU checks that are not tests: the paged kernels against the gather path (time of one
layer's attention), greedy agreement of the engine with mlx-lm, and where a decode step's time
goes as the rows grow. Runs on any device (the CPU too, without the kernels' timing).

    python -m mlx_parallm_provider.bench.gpu --tokenizer DIR [--model DIR] [--json FILE]

``--tokenizer``: a folder with ``tokenizer.json`` / ``tokenizer_config.json``; a tiny random
llama and a ~1B-shaped random 4-bit model are built from it (:mod:`.random_model`) unless
``--model`` names the model to measure.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from ..models import paged_kernels
from .lora import mlx_lm_greedy

PROMPTS = [
    "Write a haiku about the sea.", "What is the capital of France?", "List three prime numbers.", "Explain recursion briefly.",
    "Translate 'good morning' to Spanish.", "Give me a name for a cat.", "What is 17 times 23?", "Describe a rainbow in one line.",
]


def _timed(fns: dict[str, Callable[[], Any]], repeats: int = 7) -> dict[str, float]:
    """Median milliseconds of each ``fn()`` evaluated (one warm-up each first), the functions
    taking turns in every round so that the machine's drift falls on all of them alike."""
    for fn in fns.values():
        mx.eval(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def paged_step_times(launch: paged_kernels.Launch, contexts: Sequence[int] = (1000, 4000), rows: Sequence[int] = (1, 8, 32),
                     heads: int = 32, kv_heads: int = 8, head_dim: int = 64, block_size: int = 16, dtype: mx.Dtype = mx.bfloat16,
                     repeats: int = 7, quantized_bits: int = 8) -> list[dict[str, Any]]:
    """One layer's decode attention over rows of ``contexts`` tokens in shuffled blocks: the
    kernels (``launch``) against the gather path, in ms, with their largest difference; also
    over the same pools quantized to ``quantized_bits`` (``kv_cache_dtype="int8"``'s blocks;
    0 or a head size not divisible by 32: not measured)."""
    out = []
    for context in contexts:
        for B in rows:
            per_row = -(-context // block_size)
            blocks = B * per_row + 1
            order = mx.random.permutation(blocks)[: B * per_row].reshape(B, per_row).astype(mx.int32)
            k_pool = mx.random.normal((blocks * block_size, kv_heads, head_dim)).astype(dtype)
            v_pool = mx.random.normal((blocks * block_size, kv_heads, head_dim)).astype(dtype)
            queries = mx.random.normal((B, heads, 1, head_dim)).astype(dtype)
            lengths = mx.full((B,), context, dtype=mx.int32)
            scale = head_dim**-0.5
            mx.eval(order, k_pool, v_pool, queries)

            def kernel():
                return paged_kernels.paged_attention(queries, k_pool, v_pool, order, lengths, block_size, scale, launch)

            def gather():
                return paged_kernels.gathered_attention(queries, k_pool, v_pool, order, lengths, block_size, scale)

            diff = mx.abs(kernel().astype(mx.float32) - gather().astype(mx.float32)).max().item()
            fns = {"kernel": kernel, "gather": gather}
            if quantized_bits and head_dim % paged_kernels.QUANTIZED_GROUP == 0:
                kc, vc, scales = paged_kernels.quantize_pools(k_pool, v_pool, quantized_bits)
                mx.eval(kc, vc, *scales)
                fns["kernel_q"] = lambda: paged_kernels.paged_attention(queries, kc, vc, order, lengths, block_size, scale, launch,
                                                                        scales=scales, bits=quantized_bits)
                fns["gather_q"] = lambda: paged_kernels.gathered_attention(queries, kc, vc, order, lengths, block_size, scale,
                                                                           scales=scales, bits=quantized_bits)
            ms = _timed(fns, repeats)
            k_ms, g_ms = ms["kernel"], ms["gather"]
            row = {"context": context, "rows": B, "kernel_ms": k_ms, "gather_ms": g_ms, "gather_over_kernel": g_ms / k_ms, "max_diff": diff}
            if "kernel_q" in ms:
                q_diff = mx.abs(fns["kernel_q"]().astype(mx.float32) - fns["gather_q"]().astype(mx.float32)).max().item()
                row.update({f"int{quantized_bits}_kernel_ms": ms["kernel_q"], f"int{quantized_bits}_gather_ms": ms["gather_q"],
                            f"int{quantized_bits}_max_diff": q_diff})
            out.append(row)
    return out


def _prompt_ids(tokenizer: Any, n: int) -> list[list[int]]:
    return [tokenizer.encode(PROMPTS[i % len(PROMPTS)] + (" Again." * (i // len(PROMPTS)))) for i in range(n)]


def agreement(model: str, prompts: int = 8, tokens: int = 32) -> dict[str, Any]:
    """Greedy tokens of the engine (all ``prompts`` in one batch) against mlx-lm's
    ``generate_step`` on each prompt alone (its own load of the model)."""
    from ..config import EngineConfig
    from ..engine import Engine, SamplingParams
    from ..models import registry

    loaded = registry.load(model)
    ids = _prompt_ids(loaded.tokenizer, prompts)
    engine = Engine("agreement", EngineConfig(max_num_seqs=max(prompts, 1)), loaded=loaded)
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        batched = [o.token_ids for o in engine.generate_many_sync(ids, params)]
        batch_size = engine.stats()["max_batch_size"]
    finally:
        engine.shutdown()
    alone = mlx_lm_greedy(Path(model), None, ids, tokens)
    prefixes = []
    for a, b in zip(batched, alone):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(same)
    return {"model": model, "rows": prompts, "tokens": tokens, "batch_size": batch_size,
            "rows_identical": sum(a == b for a, b in zip(batched, alone)), "agreeing_prefix": prefixes}


def step_breakdown(model: str, rows: Sequence[int] = (1, 2, 4, 8, 32, 64), tokens: int = 32,
                   launch: Optional[paged_kernels.Launch] = None) -> list[dict[str, Any]]:
    """Where one decode step's time goes at each row count: the engine's measured step (p50),
    and timed alone at that size: every linear layer once (weights' matmuls and the head), the
    attention of every layer over the rows' KV (the paged kernels where ``launch``, else the
    gather path), sampling (the engine's greedy and temperature draws over the vocabulary). The rest: norms,
    RoPE, elementwise ops, Python and scheduling. ``dense_layers_ms``: the layers' matmuls (head
    aside) over dequantized copies of their weights, against which a quantized matmul that
    does not amortize its weights over the rows shows. ``unfolded_matmul_ms``: ``matmul_ms``'s
    products as mlx-lm's own layers compute them, ``(rows, 1, K)`` (on MLX's CUDA backend, one
    problem per row), where the GPU backend folds a step's rows into one matrix. ``graph_ms``: the host's time to build
    one decode step's forward graph (median; near ``step_ms``, the step waits on the host);
    ``graph_nodes``: the ops in that graph (each one the host builds, most a launch on a GPU).
    ``decode``: how the engine's decode steps ran (``Engine.stats()``); where ``"compiled"``,
    ``uncompiled_step_ms`` is the p50 step of the same run with ``compile_decode`` off.
    ``core_step_ms``: the engine's whole step at full width (p50: scheduling, the forward,
    the tokens taken and delivered), against ``mlx_lm_step_ms``, one step of mlx-lm's
    ``BatchGenerator`` decoding the same prompts as one batch (p50 of ``next()`` after its
    prefill, on the weights ``mlx-parallm bench``'s mlx-lm peers get); ``vs_mlx_lm``: their
    ratio (over 1: the engine's decode steps are the faster). ``chat_sampling_ms``: a step's
    whole sampling with every row as chat clients often ask (temperature 0.7, top_p 0.9,
    repetition_penalty 1.1: the batched filters and penalties), beside ``sampling_ms``."""
    import mlx.nn as nn

    from ..config import EngineConfig
    from ..engine import Engine, SamplingParams
    from ..engine.sampling import RowSampler, draw_tokens, sample_batch
    from ..models import backends, registry

    loaded = registry.load(model)
    m = loaded.model
    linears = [mod for name, mod in m.named_modules() if isinstance(mod, (nn.Linear, nn.QuantizedLinear)) and name != "lm_head"]
    if getattr(backends.of(m), "kernels", False):
        raise ValueError("the model runs the CPU kernels: the breakdown times MLX's ops (a GPU, or MLX_PARALLM_CPU_OPS=0)")
    args = m.args
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    embed = m.model.embed_tokens
    dtype = m.model.norm.weight.dtype  # the activations' dtype
    dense = [mx.dequantize(mod.weight, mod.scales, mod.biases, mod.group_size, mod.bits).astype(dtype) if isinstance(mod, nn.QuantizedLinear)
             else mod.weight for mod in linears]
    mx.eval(dense)
    prompt_ids = _prompt_ids(loaded.tokenizer, max(rows))
    context = max(len(p) for p in prompt_ids) + tokens // 2
    out = []
    backend = backends.of(m)

    def engine_step(R: int, compiled: bool = True) -> tuple[float, list, Optional[str], Optional[float]]:
        """The engine's p50 step at ``R`` rows, its forwards' build times, how its decode steps
        ran, its whole steps' p50 at full width."""
        device = getattr(backend, "device", None)
        if not compiled and device is not None:  # (the backend's setting, for this engine alone)
            backend.device = dataclasses.replace(device, compile_decode=False)
        engine = Engine("breakdown", EngineConfig(max_num_seqs=R), loaded=loaded)
        try:
            engine.generate_many_sync(prompt_ids[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # (its worker)
            builds = _timing_forwards(engine._core.runner)  # noqa: SLF001
            steps = _timing_steps(engine._core, R)  # noqa: SLF001
            engine.generate_many_sync(prompt_ids[:R], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
            stats = engine.stats()
            return stats["step_s"]["p50"] * 1e3, builds, stats["decode"], statistics.median(steps) * 1e3 if steps else None
        finally:
            engine.shutdown()
            if device is not None:
                backend.device = device

    peer = _mlx_lm_model(model)
    for R in rows:
        step_ms, builds, decode, core_ms = engine_step(R)
        peer_ms = mlx_lm_step_ms(peer, prompt_ids[:R], tokens)
        uncompiled_ms = engine_step(R, compiled=False)[0] if decode == "compiled" else None
        decode_builds = [(t, nodes) for rows_in, width, t, nodes in builds if rows_in == R and width == 1]
        graph_ms = statistics.median(t for t, _ in decode_builds) * 1e3 if decode_builds else None
        graph_nodes = next((nodes for _, nodes in decode_builds if nodes is not None), None)
        inputs = {_in_dims(mod): mx.random.normal((R, 1, _in_dims(mod))).astype(dtype) for mod in linears}

        def matmuls(own: bool = False):  # (own: as mlx-lm's own layers multiply, the rows not folded by the backend)
            call = _unrouted if own else (lambda layer, method, x: getattr(layer, method)(x))
            outs = [call(mod, "__call__", inputs[_in_dims(mod)]) for mod in linears]
            head = getattr(m, "lm_head", None)
            x = inputs[args.hidden_size]
            outs.append(call(head, "__call__", x) if head is not None else call(embed, "as_linear", x))
            return outs

        def dense_matmuls():  # the same products over dequantized copies (the weights read at 16 bits)
            return [inputs[w.shape[1]] @ w.T for w in dense]

        block = 16
        per_row = -(-context // block)
        table = mx.arange(R * per_row, dtype=mx.int32).reshape(R, per_row)
        pool = mx.random.normal((R * per_row * block, kv_heads, head_dim)).astype(dtype)
        q = mx.random.normal((R, heads, 1, head_dim)).astype(dtype)
        lengths = mx.full((R,), context, dtype=mx.int32)

        def attention():
            if launch is not None:
                return [paged_kernels.paged_attention(q, pool, pool, table, lengths, block, 0.125, launch) for _ in m.layers]
            return [paged_kernels.gathered_attention(q, pool, pool, table, lengths, block, 0.125) for _ in m.layers]

        logits = mx.random.normal((R, args.vocab_size))
        greedy = [RowSampler(SamplingParams(temperature=0.0)) for _ in range(R)]
        drawing = [RowSampler(SamplingParams(temperature=0.7, seed=i)) for i in range(R)]

        def sampling():  # the engine's own draws: every row greedy, every row at temperature 0.7
            return [draw_tokens(logits, greedy), draw_tokens(logits, drawing)]

        chat = [RowSampler(SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1, seed=i)) for i in range(R)]
        histories = [lambda i=i: list(range(100 + i, 140 + i)) for i in range(R)]

        def chat_sampling():
            return mx.array([row.token for row in sample_batch(logits, chat, histories)])

        ms = _timed({"matmul_ms": matmuls, "attention_ms": attention, "sampling_ms": sampling, "dense_layers_ms": dense_matmuls,
                     "chat_sampling_ms": chat_sampling, "unfolded_matmul_ms": lambda: matmuls(own=True)}, 5)
        parts = {name: ms[name] for name in ("matmul_ms", "attention_ms", "sampling_ms")}
        rest = step_ms - sum(parts.values())
        out.append({"rows": R, "step_ms": step_ms, "tokens_per_s": R / step_ms * 1e3, **parts, "rest_ms": rest,
                    "dense_layers_ms": ms["dense_layers_ms"], "unfolded_matmul_ms": ms["unfolded_matmul_ms"], "graph_ms": graph_ms,
                    "graph_nodes": graph_nodes, "decode": decode,
                    "uncompiled_step_ms": uncompiled_ms, "core_step_ms": core_ms, "mlx_lm_step_ms": peer_ms,
                    "vs_mlx_lm": peer_ms / core_ms if core_ms and peer_ms else None, "chat_sampling_ms": ms["chat_sampling_ms"]})
    return out


def _mlx_lm_model(model_dir: str) -> Any:
    """The model as ``mlx-parallm bench``'s mlx-lm peers get it: the engine's weights (as
    loaded for it: dequantized on the CPU), running mlx-lm's own code."""
    from ..models import registry

    return registry.load(model_dir, engine=False).model


def mlx_lm_step_ms(model: Any, prompts: list[list[int]], tokens: int) -> Optional[float]:
    """mlx-lm's ``BatchGenerator`` decoding ``prompts`` as one batch, greedy, ``tokens`` each,
    no stop tokens: the p50 wall time of its decode steps (``next()``) with every row in, after
    the prefill; None when too few steps ran."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, stop_tokens=None, completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    try:
        generator.insert(prompts, [tokens] * len(prompts))
        generator.next_generated()  # the prefill and each row's first token
        times = []
        while True:
            start = time.perf_counter()
            responses = generator.next_generated()
            if len(responses) < len(prompts):  # (a row ended at this step)
                break
            times.append(time.perf_counter() - start)
    finally:
        generator.close()
    return statistics.median(times) * 1e3 if times else None


def _timing_steps(core: Any, rows: int) -> list[float]:
    """Time each step of engine ``core`` from now on while ``rows`` requests run (this core's
    only): the whole step, as its worker runs it."""
    times: list[float] = []
    step = core.step

    def timed() -> Any:
        full = core.scheduler.num_running == rows
        start = time.perf_counter()
        try:
            return step()
        finally:
            if full:
                times.append(time.perf_counter() - start)

    core.step = timed
    return times


def _timing_forwards(runner: Any) -> list[tuple[int, int, float, Optional[int]]]:
    """Time each forward pass ``runner`` builds from now on (this runner's only): ``(rows,
    width, seconds, ops)`` of Python and MLX building the pass's graph, evaluating nothing (the
    host's share of a step, which overlaps the device's work on the step before); ``ops``: the
    ops in that graph, counted (after the timing) in the first decode pass (width 1) of each
    row count, else None."""
    timings: list[tuple[int, int, float, Optional[int]]] = []
    counted: set[int] = set()
    build = runner.forward

    def forward(rows: list, pieces: list, starts: list, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = build(rows, pieces, starts, *args, **kwargs)
        seconds = time.perf_counter() - start
        width = max(len(p) for p in pieces)
        nodes = graph_nodes(out) if width == 1 and len(rows) not in counted else None
        if nodes is not None:
            counted.add(len(rows))
        timings.append((len(rows), width, seconds, nodes))
        return out

    runner.forward = forward
    return timings


def _unrouted(layer: Any, method: str, x: mx.array) -> mx.array:
    """``layer``'s ``method`` over ``x`` as mlx-lm's own layer computes it: its class's before
    the backend's routing (which folds a quantized product's rows: :mod:`..models.backends.folded_rows`)."""
    from ..models.backends.routing import original_class

    return getattr(original_class(layer), method)(layer, x)


def graph_nodes(*outputs: mx.array) -> int:
    """The ops (primitives) in the unevaluated graph computing ``outputs``."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return dot.getvalue().count("shape=rectangle")


def _in_dims(layer: Any) -> int:
    import mlx.nn as nn

    return layer.weight.shape[-1] * (32 // layer.bits if isinstance(layer, nn.QuantizedLinear) else 1)


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(none)"
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder the random models are built from")
    parser.add_argument("--model", help="the model of the agreement and breakdown (default: the random ~1B 4-bit one)")
    parser.add_argument("--shape", default="1b", help="the random quantized model's shape (bench.random_model's SHAPES)")
    parser.add_argument("--rows", default="1,2,4,8,32,64")
    parser.add_argument("--contexts", default="1000,4000")
    parser.add_argument("--work", type=Path, help="where the random models are built (reused where already there)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: paged, agreement, breakdown")
    args = parser.parse_args(argv)
    from ..models.backends.gpu_kernels import MLXKernels
    from ..models.device import gpu_platform

    skip = set(filter(None, args.skip.split(",")))
    platform = gpu_platform()
    result: dict[str, Any] = {"device": str(mx.default_device()), "platform": platform, "date": time.strftime("%Y-%m-%d")}
    launch = MLXKernels(platform) if platform else None
    work = args.work or Path(tempfile.mkdtemp(prefix="parallm-gpu-bench-"))
    models: list[str] = []
    if args.model:
        models = [args.model]
    elif args.tokenizer:
        from .random_model import build

        def made(name: str, shape: str, bits: int, dtype: str) -> str:
            folder = work / name
            return str(folder if (folder / "config.json").exists() else build(folder, args.tokenizer, shape, bits=bits, dtype=dtype))

        models = [made("135m-float32", "135m", 0, "float32"), made(f"{args.shape}-4bit", args.shape, 4, "bfloat16")]

    def section(name: str, fn: Callable[[], Any]) -> None:
        if name.split("_")[0] in skip:
            return
        start = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as exc:  # one section failing still reports the others
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        shown = _table(result[name]) if isinstance(result[name], list) else json.dumps(result[name])
        print(f"\n## {name} ({time.perf_counter() - start:.0f} s)\n{shown}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))

    if launch is not None:
        section("paged", lambda: paged_step_times(launch, [int(c) for c in args.contexts.split(",")]))
    for i, model in enumerate(models):
        section(f"agreement_{i}", lambda model=model: agreement(model))
    if models:
        section("breakdown", lambda: step_breakdown(models[-1], [int(r) for r in args.rows.split(",")], launch=launch))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
