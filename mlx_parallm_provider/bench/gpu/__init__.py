"""The GPU checks that are not tests: the paged kernels against the gather path (time of one
layer's attention), greedy agreement of the engine with mlx-lm, and where a decode step's time
goes as the rows grow. Runs on any device (the CPU too, without the kernels' timing).

    python -m mlx_parallm_provider.bench.gpu --tokenizer DIR [--model DIR] [--json FILE]

One section per module: :mod:`.paged`, :mod:`.agreement`, :mod:`.breakdown` (with the
engine's timing hooks in :mod:`.timing`); :mod:`.__main__` runs them and prints their tables.
"""

from .agreement import agreement
from .breakdown import mlx_lm_step_ms, step_breakdown
from .paged import paged_step_times
from .timing import graph_nodes

__all__ = ["agreement", "graph_nodes", "mlx_lm_step_ms", "paged_step_times", "step_breakdown"]
