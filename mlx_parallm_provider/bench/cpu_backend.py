"""CPU backend benchmark: a batched decode forward at batch 1 and 32, with and without
OpenBLAS and with and without dequantized (float32) weights, in one run.

BLAS is chosen at process start, so each BLAS setting runs in a child process. Every row of
the batch decodes the same greedy continuation of one prompt, so the token ids can be
compared across settings and batch sizes.

    python -m mlx_parallm_provider.bench.cpu_backend [--model default] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

from ..config import child_environment

PROMPT = "Explain in one paragraph why the sky is blue."


def _measure(model_name: str, dequantize: bool, batches: Sequence[int], steps: int) -> list[dict[str, Any]]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from ..models import backend, registry

    loaded = registry.load(model_name, dequantize=dequantize)
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    ids = mx.array(tokenizer.encode(prompt, add_special_tokens=False))[None]
    rows = []
    for batch in batches:
        cache = make_prompt_cache(model)
        logits = model(ids, cache=cache)
        for c in cache:  # one prefill, copied to every row
            c.keys = mx.repeat(c.keys[..., : c.offset, :], batch, axis=0)
            c.values = mx.repeat(c.values[..., : c.offset, :], batch, axis=0)
        token = mx.repeat(mx.argmax(logits[:, -1, :], axis=-1), batch, axis=0)
        mx.eval(token, [c.state for c in cache])
        generated = []
        times = []
        for step in range(steps + 2):
            tic = time.perf_counter()
            logits = model(token[:, None], cache=cache)
            token = mx.argmax(logits[:, -1, :], axis=-1)
            mx.eval(token)
            if step >= 2:  # two warm-up steps
                times.append(time.perf_counter() - tic)
            generated.append(token.tolist())
        step_s = sorted(times)[len(times) // 2]
        rows.append(
            {
                "blas": backend.blas_in_use(),
                "weights": "float32 (dequantized)" if dequantize else "quantized (GGUF 4/8-bit)",
                "batch": batch,
                "step_ms": step_s * 1000,
                "tokens_per_s": batch / step_s,
                "row0_tokens": [g[0] for g in generated],
                "rows_agree": all(len(set(g)) == 1 for g in generated),
            }
        )
    return rows


def _child(args: argparse.Namespace) -> int:
    rows = []
    for dequantize in (True, False):
        rows += _measure(args.model, dequantize, args.batch, args.steps)
    print("RESULT " + json.dumps(rows))
    return 0


def run(model: str = "default", steps: int = 16, batches: Sequence[int] = (1, 32)) -> list[dict[str, Any]]:
    """Run every setting (BLAS on/off in child processes) and return the result rows."""
    results: list[dict[str, Any]] = []
    for blas in ("auto", "off"):
        env = child_environment(MLX_PARALLM_BLAS=blas)
        cmd = [sys.executable, "-m", "mlx_parallm_provider.bench.cpu_backend", "--child", "--model", model, "--steps", str(steps),
               "--batch", *map(str, batches)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"benchmark child failed (BLAS={blas}):\n{out.stderr}")
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        results += json.loads(line[len("RESULT ") :])
    return results


def report(rows: list[dict[str, Any]]) -> str:
    """Format result rows as a table, plus whether every setting produced the same tokens."""
    lines = [f"{'BLAS':<50} {'weights':<26} {'batch':>5} {'ms/step':>9} {'tok/s':>8}"]
    for r in rows:
        lines.append(f"{r['blas'][:50]:<50} {r['weights']:<26} {r['batch']:>5} {r['step_ms']:>9.1f} {r['tokens_per_s']:>8.1f}")
    reference = rows[0]["row0_tokens"]
    same = all(r["row0_tokens"] == reference and r["rows_agree"] for r in rows)
    lines.append(f"greedy tokens identical across all settings and rows: {same}")
    if not same:
        for r in rows:
            lines.append(f"  {r['blas'][:20]} {r['weights'][:9]} b={r['batch']}: {r['row0_tokens']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        import mlx_parallm_provider.models  # noqa: F401  (BLAS preload before mlx)

        return _child(args)
    rows = run(args.model, args.steps, args.batch)
    print(report(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
