"""Per-request LoRA adapters on one base model (mlx-lm's adapter format), applied per row of
a batch: :mod:`.files` reads and checks an adapter folder, :mod:`.layers` computes each row's
update, :mod:`.slots` keeps adapters resident in a bounded number of slots."""

from .files import AdapterFiles, read_adapter
from .layers import MultiLoRALinear, blocks_step_fused, rows_using
from .slots import AdapterUse, ModelAdapters, adapters_of, resident_adapters

__all__ = ["AdapterFiles", "AdapterUse", "ModelAdapters", "MultiLoRALinear", "adapters_of", "blocks_step_fused", "read_adapter",
           "resident_adapters", "rows_using"]
