"""``python -m mlx_parallm_provider.bench.gpu``: the GPU checks' sections, each printed as a
table as it ends (and all of them in ``--json``).

``--tokenizer``: a folder with ``tokenizer.json`` / ``tokenizer_config.json``; a tiny random
llama and a ~1B-shaped random 4-bit model are built from it (:mod:`..random_model`) unless
``--model`` names the model to measure.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from .agreement import agreement
from .breakdown import step_breakdown
from .paged import paged_step_times


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_parallm_provider.bench.gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer folder the random models are built from")
    parser.add_argument("--model", help="the model of the agreement and breakdown (default: the random ~1B 4-bit one)")
    parser.add_argument("--shape", default="1b", help="the random quantized model's shape (bench.random_model's SHAPES)")
    parser.add_argument("--rows", default="1,2,4,8,32,64")
    parser.add_argument("--contexts", default="1000,4000")
    parser.add_argument("--work", type=Path, help="where the random models are built (reused where already there)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: paged, agreement, breakdown")
    args = parser.parse_args(argv)
    from ...models.backends.gpu_kernels import MLXKernels
    from ...models.device import gpu_platform

    skip = set(filter(None, args.skip.split(",")))
    platform = gpu_platform()
    result: dict[str, Any] = {"device": str(mx.default_device()), "platform": platform, "date": time.strftime("%Y-%m-%d")}
    launch = MLXKernels(platform) if platform else None
    models = _models(args)

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))

    def partial(name: str, rows: list[dict[str, Any]]) -> None:  # (a section's rows so far: a run cut short keeps them)
        result[name] = list(rows)
        save()
        print(f"- {name}: {json.dumps(rows[-1])}", flush=True)

    def section(name: str, fn: Callable[[], Any]) -> None:
        if name.split("_")[0] in skip:
            return
        start = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as exc:  # one section failing still reports the others (and its rows so far)
            done = result.get(name)
            result[name] = {"error": f"{type(exc).__name__}: {exc}", **({"rows": done} if isinstance(done, list) else {})}
        shown = _table(result[name]) if isinstance(result[name], list) else json.dumps(result[name])
        print(f"\n## {name} ({time.perf_counter() - start:.0f} s)\n{shown}", flush=True)
        save()

    if launch is not None:
        section("paged", lambda: paged_step_times(launch, [int(c) for c in args.contexts.split(",")]))
    for i, model in enumerate(models):
        section(f"agreement_{i}", lambda model=model: agreement(model))
    if models:
        section("breakdown", lambda: step_breakdown(models[-1], [int(r) for r in args.rows.split(",")], launch=launch,
                                                    done=lambda rows: partial("breakdown", rows)))
    return 0


def _models(args: argparse.Namespace) -> list[str]:
    """The models measured: ``--model``, else a float32 135m-shaped one and a 4-bit ``--shape``
    one, both random, built under ``--work`` from ``--tokenizer`` (kept there, reused), else none."""
    if args.model:
        return [args.model]
    if not args.tokenizer:
        return []
    from ..random_model import build

    work = args.work or Path(tempfile.mkdtemp(prefix="parallm-gpu-bench-"))

    def made(name: str, shape: str, bits: int, dtype: str) -> str:
        folder = work / name
        return str(folder if (folder / "config.json").exists() else build(folder, args.tokenizer, shape, bits=bits, dtype=dtype))

    return [made("135m-float32", "135m", 0, "float32"), made(f"{args.shape}-4bit", args.shape, 4, "bfloat16")]


def _table(rows: list[dict[str, Any]]) -> str:
    """``rows`` (dicts with the same keys) as a Markdown table, floats to 3 significant digits."""
    if not rows:
        return "(none)"
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
