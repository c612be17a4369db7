"""Random LoRA adapters in mlx-lm's format, and mlx-lm's own greedy generation through one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


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


def mlx_lm_greedy_with_adapter(model_dir: Path, adapter: Optional[Path], prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """``mlx_lm.load(model_dir, adapter_path=adapter)`` and its greedy ``generate_step`` on each
    prompt alone (a fresh copy of the model, mlx-lm's code only)."""
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
