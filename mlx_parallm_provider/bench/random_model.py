"""A random-weight model of a real model's shape, as an mlx-lm folder, for speed measurements
where no checkpoint can be downloaded (a GPU machine off the network).

    python -m mlx_parallm_provider.bench.random_model --shape 1b --bits 4 --tokenizer DIR --out DIR

``--tokenizer``: a folder with ``tokenizer.json`` and ``tokenizer_config.json`` (its vocabulary
sets the model's); the weights are random, so the text is noise, but every matmul, attention
and sampling step costs what the real model's does.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Sequence

SHAPES: dict[str, dict] = {
    # Llama-3.2-1B's layout (its own vocabulary aside)
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 64},
    # SmolLM2-135M's layout
    "135m": {"hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536, "num_attention_heads": 9,
             "num_key_value_heads": 3, "head_dim": 64},
    # a smoke test's
    "tiny": {"hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32},
}


def build(out: Path, tokenizer: Path, shape: str = "1b", bits: int = 4, group_size: int = 64, dtype: str = "bfloat16",
          seed: int = 0) -> Path:
    """Write the random model's folder: mlx-lm's llama of ``SHAPES[shape]``, weights in
    ``dtype``, quantized to ``bits`` (0: not quantized) as ``mlx_lm.convert`` would."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    config = {"model_type": "llama", "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_traditional": False,
              "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, **SHAPES[shape]}
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    if bits:
        nn.quantize(model, group_size=group_size, bits=bits)
        config["quantization"] = {"group_size": group_size, "bits": bits}
    # Written beside ``out``, then renamed (as models.gguf.convert stages its output): a build
    # cut short (a timeout) leaves no folder that looks whole (callers take an existing
    # ``config.json`` for a built model).
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        mx.save_safetensors(str(staging / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
        (staging / "config.json").write_text(json.dumps(config, indent=1))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (staging / name).write_bytes((tokenizer / name).read_bytes())
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--bits", type=int, choices=(0, 4, 8), default=4)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    print(build(args.out, args.tokenizer, args.shape, args.bits, dtype=args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
