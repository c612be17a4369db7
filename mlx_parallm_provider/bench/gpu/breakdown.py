"""Where one decode step's time goes as the rows grow: the engine's measured steps beside its
parts timed alone (the layers' products, attention, sampling), and mlx-lm's ``BatchGenerator``
stepping the same prompts."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ...models import paged_kernels
from ...models.backends.attention_step import original_class
from ...models.backends.stacked import unstacked
from .agreement import prompt_ids
from .siblings import engine_products, in_dims, linear_layers
from .timing import timed, timing_forwards, timing_steps


def step_breakdown(model: str, rows: Sequence[int] = (1, 2, 4, 8, 32, 64), tokens: int = 32,
                   launch: Optional[paged_kernels.Launch] = None,
                   done: Optional[Callable[[list[dict[str, Any]]], None]] = None) -> list[dict[str, Any]]:
    """Where one decode step's time goes at each row count: the engine's measured step (p50),
    and timed alone at that size: every linear layer once (weights' matmuls and the head; a
    block's q/k/v and gate/up as one product each where the engine stacked them), the
    attention of every layer over the rows' KV (the paged kernels where ``launch``, else the
    gather path), sampling (the engine's greedy and temperature draws over the vocabulary). The rest: norms,
    RoPE, elementwise ops, Python and scheduling. ``dense_layers_ms``: the layers' matmuls (head
    aside) over dequantized copies of their weights, against which a quantized matmul that
    does not amortize its weights over the rows shows. ``unfolded_matmul_ms``:
    ``unstacked_matmul_ms``'s products as mlx-lm's own layers compute them, ``(rows, 1, K)`` (on MLX's CUDA backend, one
    problem per row), where the GPU backend folds a step's rows into one matrix.
    ``unstacked_matmul_ms``: ``matmul_ms``'s products with every layer its own product, q, k,
    v, gate and up apart (:mod:`.siblings`; what a step multiplies with
    ``stack_projections`` off), rows folded. ``graph_ms``: the host's time to build
    one decode step's forward graph (median; near ``step_ms``, the step waits on the host);
    ``graph_nodes``: the ops in that graph (each one the host builds, most a launch on a GPU).
    ``decode``: how the engine's decode steps ran (``Engine.stats()``); where ``"compiled"``,
    ``uncompiled_step_ms`` is the p50 step of the same run with ``compile_decode`` off.
    ``unstacked_step_ms``: the p50 step of the same run with every layer its own product
    (where the engine stacked q/k/v and gate/up: :mod:`...models.backends.stacked`).
    ``core_step_ms``: the engine's whole step at full width (p50: scheduling, the forward,
    the tokens taken and delivered), against ``mlx_lm_step_ms``, one step of mlx-lm's
    ``BatchGenerator`` decoding the same prompts as one batch (p50 of ``next()`` after its
    prefill, on the weights ``mlx-parallm bench``'s mlx-lm peers get); ``vs_mlx_lm``: their
    ratio (over 1: the engine's decode steps are the faster). ``chat_sampling_ms``: a step's
    whole sampling with every row as chat clients often ask (temperature 0.7, top_p 0.9,
    repetition_penalty 1.1: the batched filters and penalties), beside ``sampling_ms``.
    ``done(rows so far)`` is called after each row count (a run cut short keeps them)."""
    from ...models import backends, registry

    loaded = registry.load(model)
    if getattr(backends.of(loaded.model), "kernels", False):
        raise ValueError("the model runs the CPU kernels: the breakdown times MLX's ops (a GPU, or MLX_PARALLM_CPU_OPS=0)")
    parts = _Parts(loaded.model, launch)
    ids = prompt_ids(loaded.tokenizer, max(rows))
    context = max(len(p) for p in ids) + tokens // 2
    peer = mlx_lm_model(model)
    _engine_steps(loaded, ids[: max(rows)], tokens)  # (a first run, not counted: the buffers' cache grows to its size)
    out = []
    for R in rows:
        step_ms, builds, decode, core_ms = _engine_steps(loaded, ids[:R], tokens)
        peer_ms = mlx_lm_step_ms(peer, ids[:R], tokens)
        uncompiled_ms = _engine_steps(loaded, ids[:R], tokens, compiled=False)[0] if decode == "compiled" else None
        with unstacked(loaded.model) as stacks:
            unstacked_ms = _engine_steps(loaded, ids[:R], tokens)[0] if stacks else None
        decode_builds = [(t, nodes) for rows_in, width, t, nodes in builds if rows_in == R and width == 1]
        graph_ms = statistics.median(t for t, _ in decode_builds) * 1e3 if decode_builds else None
        ms = parts.times(R, context)
        main = {name: ms[name] for name in ("matmul_ms", "attention_ms", "sampling_ms")}
        out.append({"rows": R, "step_ms": step_ms, "tokens_per_s": R / step_ms * 1e3, **main, "rest_ms": step_ms - sum(main.values()),
                    "dense_layers_ms": ms["dense_layers_ms"], "unfolded_matmul_ms": ms["unfolded_matmul_ms"],
                    "unstacked_matmul_ms": ms["unstacked_matmul_ms"], "graph_ms": graph_ms,
                    "graph_nodes": next((nodes for _, nodes in decode_builds if nodes is not None), None), "decode": decode,
                    "uncompiled_step_ms": uncompiled_ms, "unstacked_step_ms": unstacked_ms, "core_step_ms": core_ms, "mlx_lm_step_ms": peer_ms,
                    "vs_mlx_lm": peer_ms / core_ms if core_ms and peer_ms else None, "chat_sampling_ms": ms["chat_sampling_ms"]})
        if done is not None:
            done(out)
    return out


def _engine_steps(loaded: Any, prompts: list[list[int]], tokens: int,
                  compiled: bool = True) -> tuple[float, list, Optional[str], Optional[float]]:
    """An engine decoding ``prompts`` greedy, ``tokens`` each, all in one batch: its p50 step
    (ms), the forwards it built (:func:`.timing.timing_forwards`), how its decode steps ran,
    the p50 of its whole steps with every row in (ms). ``compiled=False``: with the backend's
    ``compile_decode`` off, for this engine alone."""
    from ...config import EngineConfig
    from ...engine import Engine, SamplingParams
    from ...models import backends

    backend = backends.of(loaded.model)
    device = getattr(backend, "device", None)
    if not compiled and device is not None:
        backend.device = dataclasses.replace(device, compile_decode=False)
    engine = Engine("breakdown", EngineConfig(max_num_seqs=len(prompts)), loaded=loaded)
    try:
        engine.generate_many_sync(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # (its worker)
        builds = timing_forwards(engine._core.runner)  # noqa: SLF001
        steps = timing_steps(engine._core, len(prompts))  # noqa: SLF001
        engine.generate_many_sync(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        stats = engine.stats()
        return stats["step_s"]["p50"] * 1e3, builds, stats["decode"], statistics.median(steps) * 1e3 if steps else None
    finally:
        engine.shutdown()
        if device is not None:
            backend.device = device


class _Parts:
    """A decode step's parts, each timed alone at a given row count over random inputs."""

    def __init__(self, model: Any, launch: Optional[paged_kernels.Launch]) -> None:
        self.model, self.launch = model, launch
        self.linears = linear_layers(model)
        self.dtype = model.model.norm.weight.dtype  # the activations' dtype
        self.dense = [mx.dequantize(mod.weight, mod.scales, mod.biases, mod.group_size, mod.bits).astype(self.dtype)
                      if isinstance(mod, nn.QuantizedLinear) else mod.weight for mod in self.linears]
        mx.eval(self.dense)
        self.products = engine_products(model)

    def times(self, R: int, context: int) -> dict[str, float]:
        """Median ms of each part at ``R`` rows, attention over ``context`` tokens a row."""
        from ...engine import SamplingParams
        from ...engine.sampling import RowSampler, draw_tokens, sample_batch

        m, args, dtype = self.model, self.model.args, self.dtype
        heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
        inputs = {in_dims(mod): mx.random.normal((R, 1, in_dims(mod))).astype(dtype) for mod in self.linears}

        def head(call: Callable[[Any, str, mx.array], mx.array]) -> mx.array:
            layer, x = getattr(m, "lm_head", None), inputs[args.hidden_size]
            return call(layer, "__call__", x) if layer is not None else call(m.model.embed_tokens, "as_linear", x)

        def routed(layer: Any, method: str, x: mx.array) -> mx.array:
            return getattr(layer, method)(x)

        def matmuls():  # (as the engine multiplies: the siblings it stacked as one product each)
            return [p.product(inputs[p.width]) for p in self.products] + [head(routed)]

        def single_matmuls(own: bool = False):  # (own: as mlx-lm's own layers multiply, the rows not folded by the backend)
            call = unrouted if own else routed
            return [call(mod, "__call__", inputs[in_dims(mod)]) for mod in self.linears] + [head(call)]

        def dense_matmuls():  # the same products over dequantized copies (the weights read at 16 bits)
            return [inputs[w.shape[1]] @ w.T for w in self.dense]

        block = 16
        per_row = -(-context // block)
        table = mx.arange(R * per_row, dtype=mx.int32).reshape(R, per_row)
        pool = mx.random.normal((R * per_row * block, kv_heads, head_dim)).astype(dtype)
        q = mx.random.normal((R, heads, 1, head_dim)).astype(dtype)
        lengths = mx.full((R,), context, dtype=mx.int32)

        def attention():
            if self.launch is not None:
                return [paged_kernels.paged_attention(q, pool, pool, table, lengths, block, 0.125, self.launch) for _ in m.layers]
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

        return timed({"matmul_ms": matmuls, "attention_ms": attention, "sampling_ms": sampling, "dense_layers_ms": dense_matmuls,
                      "chat_sampling_ms": chat_sampling, "unfolded_matmul_ms": lambda: single_matmuls(own=True),
                      "unstacked_matmul_ms": single_matmuls}, 5)


def mlx_lm_model(model_dir: str) -> Any:
    """The model as ``mlx-parallm bench``'s mlx-lm peers get it: the engine's weights (as
    loaded for it: dequantized on the CPU), running mlx-lm's own code."""
    from ...models import registry

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


def unrouted(layer: Any, method: str, x: mx.array) -> mx.array:
    """``layer``'s ``method`` over ``x`` as mlx-lm's own layer computes it: its class's before
    the backend's routing (which folds a quantized product's rows: :mod:`...models.backends.folded_rows`)."""
    return getattr(original_class(layer), method)(layer, x)
