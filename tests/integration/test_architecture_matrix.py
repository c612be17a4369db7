"""The architecture matrix: tiny random-weight models of the families users bring, each
through the engine (issue 22, and issue 20's "tiny models of every architecture").

Each model is 2 layers of mlx-lm's own model class (hidden size 64, the SmolLM2 tokenizer's
49,152 tokens), saved as an mlx-lm folder and built once per module. For every architecture:

* greedy output of 4 prompts of different lengths decoded together == each decoded alone,
  and one of the 4 streamed carries the same token ids;
* alone == mlx-lm's own greedy generation (``generate_step`` on a copy of the folder loaded
  by mlx-lm's loader, with mlx-lm's attention and SwiGLU put back in its module);
* prefix caching on == off for a request sharing a long prefix with an earlier one;
* the paged KV layout (the default) == ``kv_layout="rectangle"``, and
  ``stats()["kv_cache"]["layout"]`` says which one ran (:data:`EXPECTED_LAYOUT`).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import pytest

from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import Engine, SamplingParams

from conftest import TINY_CONFIG, write_tiny_model

HEAD_DIM = TINY_CONFIG["head_dim"]
_COMMON = {k: TINY_CONFIG[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                                       "num_key_value_heads", "vocab_size", "bos_token_id", "eos_token_id")}
SLIDING_WINDOW = 8  # gemma3's local layers: smaller than every prompt below

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": TINY_CONFIG,
    "llama3_rope": {
        **TINY_CONFIG, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    # mlx-lm runs "mistral" as its llama; Mistral 7B v0.1's sliding_window is ignored there.
    "mistral": {**TINY_CONFIG, "model_type": "mistral", "sliding_window": 4096, "tie_word_embeddings": False,
                "rope_theta": 1000000.0},
    "qwen2": {**_COMMON, "model_type": "qwen2", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 32768, "tie_word_embeddings": True},
    "qwen3": {**_COMMON, "model_type": "qwen3", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 40960, "tie_word_embeddings": True},
    "gemma2": {**_COMMON, "model_type": "gemma2", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "query_pre_attn_scalar": HEAD_DIM, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    # Layer 0 slides (a window of 8), layer 1 is global: sliding_window_pattern 2.
    "gemma3_text": {**_COMMON, "model_type": "gemma3_text", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
                    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": HEAD_DIM,
                    "sliding_window": SLIDING_WINDOW, "sliding_window_pattern": 2, "max_position_embeddings": 32768},
    "phi3": {**_COMMON, "model_type": "phi3", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "tie_word_embeddings": False},
    "starcoder2": {**_COMMON, "model_type": "starcoder2", "norm_epsilon": 1e-5, "rope_theta": 100000.0,
                   "max_position_embeddings": 16384, "tie_word_embeddings": True},
    "olmo2": {**_COMMON, "model_type": "olmo2", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
              "max_position_embeddings": 4096, "tie_word_embeddings": False},
}
QUANTIZED = {"qwen3_4bit": ("qwen3", {"group_size": 64, "bits": 4})}  # mlx-community's usual form
ARCHITECTURES = sorted([*CONFIGS, *QUANTIZED])

# The KV layout each architecture runs on with the default kv_layout="paged", in ONE place.
# gemma3's sliding-window layers run on blocks (each query gathers its window); a module that
# computes attention itself (gemma2: softcapped scores, no scaled_dot_product_attention)
# falls back to the rectangle, logged ("KV cache: the rectangle layout (...)").
EXPECTED_LAYOUT = {name: "paged" for name in ARCHITECTURES} | {"gemma2": "rectangle"}

MAX_TOKENS = 10
PROMPT_LENGTHS = (9, 14, 21, 30)  # all longer than gemma3's window
PREFIX_LENGTH = 40  # two full blocks of 16 and then some
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(22)
    return [[1] + [rng.randrange(3, TINY_CONFIG["vocab_size"]) for _ in range(n - 1)] for n in PROMPT_LENGTHS]


def _prefix_prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(20)
    prefix = [1] + [rng.randrange(3, TINY_CONFIG["vocab_size"]) for _ in range(PREFIX_LENGTH - 1)]
    return prefix + [rng.randrange(3, 1000) for _ in range(5)], prefix + [rng.randrange(3, 1000) for _ in range(7)]


def _quantize_folder(folder: Path, quantization: dict[str, int]) -> Path:
    """Quantize the float folder in place as mlx-lm's convert does (``nn.quantize``, the
    ``quantization`` key in config.json)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(folder)
    nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"])
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    config = {**json.loads((folder / "config.json").read_text()), "quantization": quantization}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@contextmanager
def _mlx_lm_functions(model: Any):
    """mlx-lm's own attention and SwiGLU in the model's module for the duration (the engine's
    load routes them through :mod:`mlx_parallm_provider.models.attention`)."""
    from mlx_parallm_provider.models import attention

    module = sys.modules[type(model).__module__]
    originals = {"scaled_dot_product_attention": attention.mlx_lm_attention, "swiglu": attention.mlx_lm_swiglu}
    saved = {name: getattr(module, name) for name in originals if hasattr(module, name)}
    for name in saved:
        setattr(module, name, originals[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def mlx_lm_greedy(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """mlx-lm's own greedy generation of each prompt on a separately loaded copy of the folder."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)  # mlx_lm.load without its tokenizer (the same for every architecture)
    out = []
    with _mlx_lm_functions(model):
        for prompt in prompts:
            steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1))
            out.append([int(token) for token, _ in steps])
    return out


class Arch:
    """One architecture's folder, loaded model, engines (made on first use, each once) and
    results (computed on first use, each once), shared by the module's tests."""

    def __init__(self, name: str, folder: Path) -> None:
        from mlx_parallm_provider.models import registry

        self.name, self.folder = name, folder
        self.prompts = _prompts()
        self.reference = mlx_lm_greedy(folder, self.prompts, MAX_TOKENS)  # before any engine runs
        self.loaded = registry.load(str(folder))
        self._engines: dict[tuple, Engine] = {}
        self._results: dict[str, Any] = {}

    def engine(self, **config: Any) -> Engine:
        key = tuple(sorted(config.items()))
        if key not in self._engines:
            self._engines[key] = Engine(self.name, EngineConfig(**config), loaded=self.loaded)
        return self._engines[key]

    def once(self, key: str, compute) -> Any:
        if key not in self._results:
            self._results[key] = compute()
        return self._results[key]

    def alone(self) -> list[list[int]]:
        engine = self.engine()
        return self.once("alone", lambda: [engine.generate_sync(p, GREEDY).token_ids for p in self.prompts])

    def together(self, **config: Any) -> tuple[list[list[int]], list[int]]:
        """The 4 prompts decoded at once (the first streamed): completions' ids, streamed ids."""
        engine = self.engine(**config)

        async def stream(prompt):
            ids = []
            async for delta in engine.stream(prompt, GREEDY):
                ids.extend(delta.token_ids)
            return ids

        async def run():
            return await asyncio.gather(stream(self.prompts[0]), *(engine.generate(p, GREEDY) for p in self.prompts[1:]))

        def compute():
            streamed, *done = asyncio.run(run())
            return [streamed, *(c.token_ids for c in done)], streamed

        return self.once(f"together{sorted(config.items())}", compute)

    def shutdown(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request, smollm_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    base, quantization = QUANTIZED.get(name, (name, None))
    folder = write_tiny_model(tmp_path_factory.mktemp(name), smollm_tokenizer_dir, config=CONFIGS[base])
    if quantization is not None:
        _quantize_folder(folder, quantization)
    built = Arch(name, folder)
    yield built
    built.shutdown()


def test_batched_equals_alone(arch: Arch) -> None:
    together, streamed = arch.together()
    assert together == arch.alone()
    assert len(streamed) == MAX_TOKENS
    assert arch.engine().stats()["max_batch_size"] >= 2  # they really decoded together


def test_alone_equals_mlx_lm_greedy(arch: Arch) -> None:
    assert arch.alone() == arch.reference


def test_prefix_caching_on_equals_off(arch: Arch) -> None:
    first, second = _prefix_prompts()

    def run(engine: Engine):
        return [engine.generate_sync(p, GREEDY) for p in (first, second)]

    on, off = run(arch.engine()), run(arch.engine(enable_prefix_caching=False))
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    assert on[1].usage.cached_tokens > 0 and off[1].usage.cached_tokens == 0  # the second really reused the prefix


def test_the_layout_that_runs_is_the_expected_one(arch: Arch) -> None:
    assert arch.engine().stats()["kv_cache"]["layout"] == EXPECTED_LAYOUT[arch.name]
    assert arch.engine(kv_layout="rectangle").stats()["kv_cache"]["layout"] == "rectangle"


def test_paged_equals_rectangle(arch: Arch) -> None:
    assert arch.together(kv_layout="rectangle")[0] == arch.together()[0]
