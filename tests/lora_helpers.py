"""Random LoRA adapters in mlx-lm's format, and mlx-lm's own greedy generation through one
(the benchmark's functions: :mod:`mlx_parallm_provider.bench.lora`)."""

from mlx_parallm_provider.bench.lora import mlx_lm_greedy as mlx_lm_greedy_with_adapter
from mlx_parallm_provider.bench.lora import write_random_adapter

__all__ = ["mlx_lm_greedy_with_adapter", "write_random_adapter"]
