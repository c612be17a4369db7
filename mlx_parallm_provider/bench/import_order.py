"""A 64-row decode step of a model with ``mlx`` imported before and after this package.

    python -m mlx_parallm_provider.bench.import_order [--model default] [--rows 64] [--repeat 7]

Each order runs in a fresh subprocess (the order is fixed at process start): the model is
loaded as the engine loads it and one token a row goes through it (the step's matmuls; no
KV), timed ``--repeat`` times after a warm-up; ``--rounds`` alternating pairs. Prints each
median, whether the outputs agree, and the median ratio over the rounds (the machine's noise
shows in its range).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

STEP = """
import json, sys, time
order, model_name, rows, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if order == "mlx-first":
    import mlx.core as mx
    import mlx_parallm_provider
else:
    import mlx_parallm_provider.models  # (the package's first use of mlx: the BLAS preloaded first)
    import mlx.core as mx
from mlx_parallm_provider.models import backend, private_blas, registry

model = registry.load(model_name).model
tokens = mx.array([[5 + i] for i in range(rows)])
mx.eval(model(tokens))
times = []
for _ in range(repeat):
    tic = time.perf_counter()
    out = model(tokens)
    mx.eval(out)
    times.append(time.perf_counter() - tic)
times.sort()
print(json.dumps({"order": order, "median_ms": times[len(times) // 2] * 1000, "blas": backend.blas_in_use(),
                  "private_blas": private_blas._bound is not None, "checksum": float(out[:, -1, :16].sum())}))
"""


def run_order(order: str, model: str, rows: int, repeat: int) -> dict:
    """One order's figures, from a fresh interpreter."""
    done = subprocess.run([sys.executable, "-c", STEP, order, model, str(rows), str(repeat)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=3, help="alternating pairs of runs; the median ratio is reported")
    args = parser.parse_args(argv)
    ratios = []
    for _ in range(args.rounds):
        usual = run_order("package-first", args.model, args.rows, args.repeat)
        first = run_order("mlx-first", args.model, args.rows, args.repeat)
        ratios.append(first["median_ms"] / usual["median_ms"])
        for r in (usual, first):
            print(f"{r['order']:>14}: {r['median_ms']:8.1f} ms a {args.rows}-row step  blas={r['blas']}  private OpenBLAS={r['private_blas']}")
        print(f"  outputs agree: {abs(first['checksum'] - usual['checksum']) <= 1e-3 * max(1.0, abs(usual['checksum']))}")
    ratios.sort()
    print(f"mlx-first / package-first: median {ratios[len(ratios) // 2]:.3f} over {len(ratios)} rounds "
          f"(range {ratios[0]:.3f}-{ratios[-1]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
