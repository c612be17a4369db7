"""Per-request LoRA adapters in one batch, measured in one run.

    python -m mlx_parallm_provider.bench.lora [--model default] [--rows 32] [--new-tokens 64]
        [--repeats 5] [--rank 8] [--num-layers 16]

Three random adapters in mlx-lm's format (``mlx_lm.lora``'s layers on a copy of the model,
its ``lora_b`` made random so that answers change: what training leaves) are written first.

1. **identity**: 8 rows in one batch (``max_num_seqs=8``), adapters none, A, B, C twice over,
   greedy: each row's tokens against ``mlx_lm.load(model, adapter_path=...)``'s greedy
   generation of that prompt alone;
2. **decode throughput**: ``--rows`` rows over 4 adapters (none, A, B, C, in turn) against
   ``--rows`` rows of the base model alone, ``--new-tokens`` each (short prompts, prefix
   cached after the first run); the two alternate each repeat; medians, their ratio, and the
   median of each repeat's ratio (the two runs next to each other);
3. **ways of computing the updates**: one step's updates of every adapted layer, ``--rows`` rows
   over 4 adapters: gathered per row (two ``gather_mm``, what the engine runs off the CPU),
   grouped by adapter (rows taken per adapter, two matmuls each, put back in order), and the
   CPU extension's one op a layer (what the engine runs on the CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from ..cpu_info import cpu_model_name

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colours:",
           "Write a haiku about rain.", "1, 2, 3, 4,", "Translate to German: cat", "Hello! How are"]


def write_random_adapter(folder: Path, model_dir: Path, *, rank: int = 8, scale: float = 10.0, num_layers: int = -1,
                         keys: Optional[list[str]] = None, seed: int = 0, b_std: float = 0.05) -> Path:
    """Write an adapter for the model in ``model_dir`` as ``mlx_lm.lora`` would after training:
    mlx-lm's own ``linear_to_lora_layers`` on a copy of the model, its ``lora_b`` (zeros at
    first) made random so the adapter changes the answers. Returns ``folder``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    mx.random.seed(seed)
    model, _ = load_model(Path(model_dir))
    params: dict[str, Any] = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = keys
    linear_to_lora_layers(model, num_layers, params)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith(".lora_a"):
            weights[name] = value
        elif name.endswith(".lora_b"):
            weights[name] = mx.random.normal(value.shape) * b_std
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    (folder / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}))
    return folder


def mlx_lm_greedy(model_dir: Path, adapter: Optional[Path], prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """``mlx_lm.load(model_dir, adapter_path=adapter)``'s model (a fresh copy, mlx-lm's code
    only) and its greedy ``generate_step`` on each prompt alone."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_dir))
    if adapter is not None:
        load_adapters(model, str(adapter))
        model.eval()
    out = []
    for prompt in prompts:
        steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1))
        out.append([int(token) for token, _ in steps])
    return out


def identity(model: str, loaded: Any, adapters: list[Path], max_tokens: int) -> list[tuple[str, bool, bool]]:
    """Per row of one batch of 8: (adapter, same tokens as mlx-lm alone, differs from the base model)."""
    from ..config import EngineConfig
    from ..engine import Engine, SamplingParams

    engine = Engine(model, EngineConfig(max_num_seqs=8, batch_window_ms=200), loaded=loaded)
    try:
        prompts = [engine.encode(p) for p in PROMPTS]
        for adapter in adapters:  # (resident first, so the 8 rows arrive within the batch window)
            engine.generate_sync(prompts[0], SamplingParams(max_tokens=1, lora=str(adapter)))
        choice: list[Optional[Path]] = [None, *adapters] * 2
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, lora=None if a is None else str(a)) for a in choice]
        got = [c.token_ids for c in engine.generate_many_sync(prompts, params)]
        batch = engine.stats()["max_batch_size"]
    finally:
        engine.shutdown()
    base = mlx_lm_greedy(loaded.path, None, prompts, max_tokens)
    rows = []
    for row, (adapter, prompt) in enumerate(zip(choice, prompts)):
        want = mlx_lm_greedy(loaded.path, adapter, [prompt], max_tokens)[0]
        rows.append((f"{'none' if adapter is None else adapter.name} (batch {batch})", got[row] == want, got[row] != base[row]))
    return rows


def throughput(model: str, loaded: Any, adapters: list[Path], rows: int, new_tokens: int, repeats: int) -> dict[str, list[float]]:
    """Decode tokens/s of ``rows`` rows of the base alone and over 4 adapters, alternating."""
    from ..config import EngineConfig
    from ..engine import Engine, SamplingParams

    engine = Engine(model, EngineConfig(max_num_seqs=rows), loaded=loaded)
    texts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(rows)]
    choice = {"base": [None] * rows, "4 adapters": [None if i % 4 == 0 else str(adapters[i % 4 - 1]) for i in range(rows)]}
    out: dict[str, list[float]] = {name: [] for name in choice}
    try:
        for repeat in range(repeats + 1):
            for name, loras in choice.items():
                params = [SamplingParams(max_tokens=new_tokens, ignore_eos=True, lora=lora) for lora in loras]
                tic = time.perf_counter()
                done = engine.generate_many_sync(texts, params)
                rate = sum(len(c.token_ids) for c in done) / (time.perf_counter() - tic)
                if repeat:  # (the first: warm-up, prompts into the prefix store)
                    out[name].append(rate)
    finally:
        engine.shutdown()
    return out


def gathered_vs_grouped(loaded: Any, rows: int, repeats: int) -> dict[str, float]:
    """Milliseconds of one step's updates of every adapted layer: gathered per row vs grouped by adapter."""
    import mlx.core as mx

    from ..models.lora.layers import _update_op
    from ..models.lora.slots import resident_adapters

    layers = list(resident_adapters(loaded.model)._wrapped.values())  # (the adapters the throughput run made resident)
    slots = mx.array([i % 4 for i in range(rows)], dtype=mx.uint32)
    groups = [[i for i in range(rows) if i % 4 == k] for k in range(4)]
    order = mx.array([i for g in groups for i in g])
    back = mx.argsort(order)
    xs = {id(layer): mx.random.normal((rows, 1, layer.input_dims)) for layer in layers}
    mx.eval(list(xs.values()))

    def gathered() -> list[mx.array]:
        return [mx.gather_mm(mx.gather_mm(xs[id(l)], l._lora_a, rhs_indices=slots), l._lora_b, rhs_indices=slots) for l in layers]

    def grouped() -> list[mx.array]:
        outs = []
        for l in layers:
            x = xs[id(l)]
            parts = [(x[mx.array(g)] @ l._lora_a[k]) @ l._lora_b[k] for k, g in enumerate(groups) if g and k < l.slots]
            outs.append(mx.concatenate(parts)[back])
        return outs

    op = _update_op()
    flat = mx.full((rows,), 10.0)
    ys = {id(layer): mx.zeros((rows, 1, layer.output_dims)) for layer in layers}
    mx.eval(flat, list(ys.values()))

    def one_op() -> list[mx.array]:
        return [op(ys[id(l)], xs[id(l)], l._lora_a_t, l._lora_b, slots, flat, 1) for l in layers]

    ways = [("gathered", gathered), ("grouped", grouped), *([("one op", one_op)] if op is not None else [])]
    times: dict[str, list[float]] = {name: [] for name, _ in ways}
    for _ in range(repeats + 1):
        for name, fn in ways:
            tic = time.perf_counter()
            mx.eval(fn())
            times[name].append(1000 * (time.perf_counter() - tic))
    return {name: statistics.median(t[1:]) for name, t in times.items()} | {"layers": len(layers)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", type=int, default=32, help="rows of the throughput run (2, 3)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens each row generates (2)")
    ap.add_argument("--identity-tokens", type=int, default=24, help="tokens each row generates (1)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--num-layers", type=int, default=16, help="adapted layers, the last ones (mlx_lm.lora's default: 16)")
    ap.add_argument("--skip", default="", help="comma-separated parts not to run: identity,throughput,grouping")
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)

    from ..models import backends, registry

    loaded = registry.load(args.model)
    print(f"{datetime.date.today()} · CPU: {cpu_model_name()}; {os.cpu_count()} CPUs · model {args.model} · backend "
          f"{getattr(backends.of(loaded.model), 'name', None)} · adapters rank {args.rank}, last {args.num_layers} layers, every linear layer")
    with tempfile.TemporaryDirectory(prefix="mlx-parallm-lora-") as tmp:
        adapters = [write_random_adapter(Path(tmp) / name, loaded.path, rank=args.rank, num_layers=args.num_layers, seed=i, b_std=0.02)
                    for i, name in enumerate(("A", "B", "C"), 1)]
        if "identity" not in skip:
            rows = identity(args.model, loaded, adapters, args.identity_tokens)
            print(f"\n## 8 rows in one batch, {args.identity_tokens} greedy tokens each, against mlx-lm with each adapter alone\n\n"
                  "| row | adapter | same tokens as mlx-lm | differs from the base |\n|---:|---|---|---|")
            for i, (name, same, differs) in enumerate(rows):
                print(f"| {i} | {name} | {'yes' if same else 'NO'} | {'yes' if differs else 'no'} |")
            print(f"\nidentical rows: {sum(same for _, same, _ in rows)} of {len(rows)}")
        if "throughput" not in skip:
            t = throughput(args.model, loaded, adapters, args.rows, args.new_tokens, args.repeats)
            base, mixed = statistics.median(t["base"]), statistics.median(t["4 adapters"])
            paired = statistics.median(m / b for b, m in zip(t["base"], t["4 adapters"]))
            print(f"\n## Decode throughput, {args.rows} rows x {args.new_tokens} tokens (medians of {args.repeats}, alternating)\n\n"
                  f"| rows | tokens/s | vs base |\n|---|---:|---:|\n| base model alone | {base:.1f} | 1.00x |\n"
                  f"| 4 adapters (none, A, B, C) | {mixed:.1f} | {mixed / base:.2f}x |\n\nmedian of each repeat's ratio: {paired:.2f}x")
            print("tokens/s, every repeat: " + "; ".join(f"{k} {', '.join(f'{x:.0f}' for x in v)}" for k, v in t.items()))
        if "grouping" not in skip and "throughput" not in skip:
            g = gathered_vs_grouped(loaded, args.rows, args.repeats * 4)
            print(f"\n## One step's updates of {g['layers']} adapted layers, {args.rows} rows over 4 adapters (medians)\n\n"
                  f"| way | ms |\n|---|---:|\n| gathered per row (two gather_mm, the scale, the sum) | {g['gathered']:.2f} |\n"
                  f"| grouped by adapter | {g['grouped']:.2f} |" + (f"\n| one op of the CPU extension (what the engine runs here) | "
                                                                      f"{g['one op']:.2f} |" if "one op" in g else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
