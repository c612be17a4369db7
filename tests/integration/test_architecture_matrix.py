"""The architecture matrix: tiny random-weight models of the families users bring, each
through the engine (issue 22, and issue 20's "tiny models of every architecture").

Each model is 2 layers of mlx-lm's own model class (hidden size 64, the SmolLM2 tokenizer's
49,152 tokens), saved as an mlx-lm folder and built once per module; variants are the folder
4-bit / mxfp4-quantized or stored as bfloat16. For every architecture (the test ids count
them: architectures x checks):

* greedy output of 4 prompts of different lengths decoded together == each decoded alone;
* the one of the 4 streamed: its deltas join to its completion (token ids and text);
* alone == mlx-lm's own greedy generation (``generate_step`` on a copy of the folder loaded
  by mlx-lm's loader, with mlx-lm's attention and SwiGLU put back in its module);
* this package's CPU kernels (the default backend on the CPU) == MLX's own ops;
* a JSON schema through the constrained path: the output parses and validates;
* prefix caching on == off for a request sharing a long prefix with an earlier one (a hybrid
  model's reaching the state kept at the earlier prompt's last block boundary);
* the attention is routed through the paged KV's ``attend`` (gemma2's softcapped attention too).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conftest import HYBRID_CONFIGS, TINY_CONFIG, write_tiny_model
from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import Completion, Constraint, Delta, Engine, SamplingParams

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
    # Qwen pads its embeddings past its tokenizer (151,936 rows, 151,665 tokens): 64 rows no token has.
    "qwen2": {**_COMMON, "vocab_size": TINY_CONFIG["vocab_size"] + 64, "model_type": "qwen2", "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": True},
    "qwen3": {**_COMMON, "model_type": "qwen3", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "max_position_embeddings": 40960, "tie_word_embeddings": True},
    "gemma2": {**_COMMON, "model_type": "gemma2", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "query_pre_attn_scalar": HEAD_DIM, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    # Layer 0 slides (a window of 8), layer 1 is global: sliding_window_pattern 2.
    "gemma3_text": {**_COMMON, "model_type": "gemma3_text", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
                    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": HEAD_DIM,
                    "sliding_window": SLIDING_WINDOW, "sliding_window_pattern": 2, "max_position_embeddings": 32768},
    # Gemma 3's mlx-community checkpoints (4B and up) are its multimodal wrapper, "gemma3", whose
    # text model's layers live in gemma3_text: routed through their own module.
    "gemma3": {"model_type": "gemma3", "vocab_size": _COMMON["vocab_size"],
               "text_config": {**_COMMON, "model_type": "gemma3_text", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
                               "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": HEAD_DIM,
                               "sliding_window": SLIDING_WINDOW, "sliding_window_pattern": 2,
                               "max_position_embeddings": 32768}},
    # SmolLM3: llama's layers (defined in mlx_lm.models.llama), no RoPE in every 2nd layer here.
    "smollm3": {**TINY_CONFIG, "model_type": "smollm3", "no_rope_layer_interval": 2},
    "phi3": {**_COMMON, "model_type": "phi3", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "tie_word_embeddings": False},
    "starcoder2": {**_COMMON, "model_type": "starcoder2", "norm_epsilon": 1e-5, "rope_theta": 100000.0,
                   "max_position_embeddings": 16384, "tie_word_embeddings": True},
    "olmo2": {**_COMMON, "model_type": "olmo2", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
              "max_position_embeddings": 4096, "tie_word_embeddings": False},
    "granite": {**_COMMON, "model_type": "granite", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "max_position_embeddings": 4096, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
                "logits_scaling": 8.0, "attention_multiplier": 1 / HEAD_DIM, "embedding_multiplier": 12.0,
                "residual_multiplier": 0.22},
    # 4 experts, 2 per token, in both layers.
    "qwen3_moe": {**_COMMON, "model_type": "qwen3_moe", "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6,
                  "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
                  "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "moe_intermediate_size": 32, "norm_topk_prob": True},
    # Phi-3.5 / Phi-4-mini: longrope (test_rope_scaling_models.py had this config alone; the matrix
    # runs every check on it instead).
    "phi3_longrope": {**_COMMON, "model_type": "phi3", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                      "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                      "tie_word_embeddings": True,
                      "rope_scaling": {"type": "longrope", "long_factor": [1.0 + i / 4 for i in range(HEAD_DIM // 2)],
                                       "short_factor": [1.0 + i / 16 for i in range(HEAD_DIM // 2)]}},
    # gpt-oss: attention sinks, YaRN, 4 experts; layer 0 slides (a window of 8), layer 1 is global.
    "gpt_oss": {**_COMMON, "model_type": "gpt_oss", "head_dim": HEAD_DIM, "intermediate_size": 64,
                "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "sliding_window": SLIDING_WINDOW,
                "rope_theta": 150000, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                "layer_types": ["sliding_attention", "full_attention"],
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 4096}},
    # Hybrid models: LFM2 (short convolutions), Qwen3.5 (gated DeltaNet), Granite 4.0-H (Mamba 2).
    **HYBRID_CONFIGS,
}
# Variants: an architecture's folder rewritten as users get it from mlx-community.
QUANTIZED = {
    "qwen3_4bit": ("qwen3", {"group_size": 64, "bits": 4}),
    # gpt-oss's own format, here on qwen3: a gpt_oss folder in it cost 2.5x as much. The packed
    # kernel reads affine layouts only, so on the CPU mxfp4 layers are dequantized at load.
    "qwen3_mxfp4": ("qwen3", {"group_size": 32, "bits": 4, "mode": "mxfp4"}),
}
BFLOAT16 = {"llama3_rope_bf16": "llama3_rope"}  # Llama 3.2's mlx-community folders are bf16
ARCHITECTURES = sorted([*CONFIGS, *QUANTIZED, *BFLOAT16])

# Every architecture runs on KV blocks, its attention routed through the blocks' attend()
# (gemma3's and gpt_oss's sliding-window layers gather each query's window; gpt_oss's sinks
# and gemma2's softcap reach the gathered attention; gemma3 (the wrapper) and smollm3 are
# routed through the module their layers come from; gemma2's attention, which computes its
# softcapped scores itself, is replaced by one calling attend()).

# Architectures whose decode steps the CPU kernels' fused attention never runs (on == off holds
# trivially there, so the check asserts that too): attention with a softcap (gemma2) or sinks
# (gpt_oss) takes MLX's attention over the gathered blocks.
NO_DECODE_KERNEL = {"gemma2", "gpt_oss"}

MAX_TOKENS = 10
PROMPT_LENGTHS = (9, 14, 21, 30)  # all longer than gemma3's window
PREFIX_LENGTH = 40  # two full blocks of 16 and then some
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
CITIES = ("Paris", "Oslo", "Lima")
SCHEMA = {  # no free whitespace (llguidance's fixed ", " and ": "): no output is longer than LONGEST
    "x-guidance": {"whitespace_flexible": False},
    "type": "object",
    "properties": {"city": {"enum": list(CITIES)}, "days": {"type": "integer", "minimum": 0, "maximum": 9},
                   "sunny": {"type": "boolean"}},
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}
LONGEST = '{"city": "Paris", "days": 9, "sunny": false}'  # one token per character at worst


def _prompts() -> list[list[int]]:
    rng = random.Random(22)
    return [[1] + [rng.randrange(3, TINY_CONFIG["vocab_size"]) for _ in range(n - 1)] for n in PROMPT_LENGTHS]


def _prefix_prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(20)
    prefix = [1] + [rng.randrange(3, TINY_CONFIG["vocab_size"]) for _ in range(PREFIX_LENGTH - 1)]
    return prefix + [rng.randrange(3, 1000) for _ in range(5)], prefix + [rng.randrange(3, 1000) for _ in range(7)]


def _quantize_folder(folder: Path, quantization: dict[str, Any]) -> Path:
    """Quantize the float folder in place as mlx-lm's convert does (``nn.quantize``, the
    ``quantization`` key in config.json)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(folder)
    nn.quantize(model, **quantization)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"})
    config = {**json.loads((folder / "config.json").read_text()), "quantization": quantization}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _bfloat16_folder(folder: Path) -> Path:
    """Store the float folder's weights as bfloat16, as a Hugging Face bf16 checkpoint converted
    by mlx-lm is."""
    import mlx.core as mx

    weights = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = {**json.loads((folder / "config.json").read_text()), "torch_dtype": "bfloat16"}
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


def mlx_lm_greedy(folder: Path, prompts: list[list[int]], max_tokens: int, upcast: bool = False) -> list[list[int]]:
    """mlx-lm's own greedy generation of each prompt on a separately loaded copy of the folder
    (with ``upcast``, its weights cast to float32 first)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(folder)  # mlx_lm.load without its tokenizer (the same for every architecture)
    if upcast:
        model.set_dtype(mx.float32)
    out = []
    with _mlx_lm_functions(model):
        for prompt in prompts:
            steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1))
            out.append([int(token) for token, _ in steps])
    return out


_SHARED_TOKENIZER: dict[str, Any] = {}


class Arch:
    """One architecture's folder, loaded model, engines (made on first use, each once) and
    results (computed on first use, each once), shared by the module's tests."""

    def __init__(self, name: str, folder: Path) -> None:
        from mlx_parallm_provider.models import backend, registry

        self.name, self.folder = name, folder
        self.prompts = _prompts()
        # A bf16 folder computes in float32 on the CPU (every bfloat16 is exactly a float32), so
        # mlx-lm's greedy is taken on the same weights upcast: the same function on the same
        # numbers. mlx-lm in bfloat16 rounds every activation: 2 of the 4 prompts diverged
        # there (after 4 and 7 tokens), a difference of precision, not of the engine.
        self.upcast = name in BFLOAT16 and backend.is_cpu()
        self.reference = mlx_lm_greedy(folder, self.prompts, MAX_TOKENS, self.upcast)  # before any engine runs
        loaded = registry.load(str(folder))
        # Every folder holds copies of one tokenizer's files: the engines share one tokenizer
        # object, so llguidance's table of it is built once in the module, not per architecture.
        self.loaded = replace(loaded, tokenizer=_SHARED_TOKENIZER.setdefault("smollm2", loaded.tokenizer))
        self._engines: dict[tuple, Engine] = {}
        self._results: dict[str, Any] = {}
        self.kernel_decodes = self._count_kernel_decodes()

    def _count_kernel_decodes(self) -> list[int]:
        """Count the decode steps the model's own backend answers with its fused kernel (a
        result, not None) in the one-element list returned."""
        from mlx_parallm_provider.models import backends

        ops, count = backends.of(self.loaded.model), [0]
        for name in ("decode_attention", "paged_decode_attention"):
            def counted(*args: Any, _method=getattr(ops, name), **kwargs: Any) -> Any:
                out = _method(*args, **kwargs)
                count[0] += out is not None
                return out

            setattr(ops, name, counted)  # on this model's backend instance alone
        return count

    def engine(self, **config: Any) -> Engine:
        key = tuple(sorted(config.items()))
        if key not in self._engines:
            self._engines[key] = Engine(self.name, EngineConfig(**config), loaded=self.loaded)
        return self._engines[key]

    def once(self, key: str, compute) -> Any:
        if key not in self._results:
            self._results[key] = compute()
        return self._results[key]

    def alone(self) -> list[Completion]:
        engine = self.engine()
        return self.once("alone", lambda: [engine.generate_sync(p, GREEDY) for p in self.prompts])

    def together(self, **config: Any) -> tuple[list[list[int]], list[Delta]]:
        """The 4 prompts decoded at once (the first streamed): completions' ids, the stream's deltas."""
        return self.once(f"together{sorted(config.items())}", lambda: _together(self.engine(**config), self.prompts))

    def together_on_mlx_ops(self) -> list[list[int]]:
        """:meth:`together` on an engine whose model runs MLX's own ops (the backend an engine
        gets with ``MLX_PARALLM_CPU_OPS=0``), the model's own backend again after."""
        from mlx_parallm_provider.models import backends

        def compute():
            with backends.using(self.loaded.model, "mlx") as ops:
                assert not ops.kernels
                engine = Engine(self.name, EngineConfig(), loaded=self.loaded)
                try:
                    return _together(engine, self.prompts)[0]
                finally:
                    engine.shutdown()

        return self.once("mlx_ops", compute)

    def shutdown(self) -> None:
        for engine in self._engines.values():
            engine.shutdown()


def _together(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[Delta]]:
    async def stream(prompt):
        return [delta async for delta in engine.stream(prompt, GREEDY)]

    async def run():
        return await asyncio.gather(stream(prompts[0]), *(engine.generate(p, GREEDY) for p in prompts[1:]))

    deltas, *done = asyncio.run(run())
    return [[i for d in deltas for i in d.token_ids], *(c.token_ids for c in done)], deltas


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request, smollm_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    name = request.param
    base, quantization = QUANTIZED.get(name, (BFLOAT16.get(name, name), None))
    folder = write_tiny_model(tmp_path_factory.mktemp(name), smollm_tokenizer_dir, config=CONFIGS[base])
    if quantization is not None:
        _quantize_folder(folder, quantization)
    if name in BFLOAT16:
        _bfloat16_folder(folder)
    built = Arch(name, folder)
    yield built
    built.shutdown()


def test_batched_equals_alone(arch: Arch) -> None:
    together, _ = arch.together()
    assert together == [c.token_ids for c in arch.alone()]
    assert arch.engine().stats()["max_batch_size"] >= 2  # they really decoded together


def test_stream_equals_completion(arch: Arch) -> None:
    """The streamed request's deltas join to the same request's completion: every token id
    (none held back with its text) and the text."""
    _, deltas = arch.together()
    completion = arch.alone()[0]
    assert [i for d in deltas for i in d.token_ids] == completion.token_ids and len(completion.token_ids) == MAX_TOKENS
    assert "".join(d.text for d in deltas) == completion.text
    assert deltas[-1].finish_reason == completion.finish_reason == "length"


def test_alone_equals_mlx_lm_greedy(arch: Arch) -> None:
    assert [c.token_ids for c in arch.alone()] == arch.reference
    if arch.upcast:  # what makes the upcast reference the honest one
        import mlx.core as mx
        from mlx.utils import tree_flatten

        assert {v.dtype for _, v in tree_flatten(arch.loaded.model.parameters())} == {mx.float32}


def test_cpu_kernels_on_equals_off(arch: Arch) -> None:
    from mlx_parallm_provider.models import backend, backends

    on = arch.together()[0]
    if backend.is_cpu():  # the default backend there: this package's kernels, and they ran
        assert backends.of(arch.loaded.model).kernels
        assert (arch.kernel_decodes[0] > 0) == (arch.name not in NO_DECODE_KERNEL), arch.kernel_decodes
    assert arch.together_on_mlx_ops() == on
    assert backends.of(arch.loaded.model) is arch.loaded.backend  # its own backend again


def test_constrained_output_is_valid(arch: Arch) -> None:
    """A JSON schema through the engine's constrained path, batched with a plain request. The
    schema admits no free whitespace, so every output has at most ``len(LONGEST)`` characters
    and the grammar ends it (``finish_reason='stop'``) within ``max_tokens``."""
    params = SamplingParams(max_tokens=len(LONGEST) + 1, constraint=Constraint.json_schema(SCHEMA))
    engine = arch.engine()

    async def run():
        return await asyncio.gather(engine.generate(arch.prompts[0], params), engine.generate(arch.prompts[1], GREEDY))

    constrained, plain = arch.once("constrained", lambda: asyncio.run(run()))
    assert constrained.finish_reason == "stop", constrained.text
    value = json.loads(constrained.text)
    assert constrained.text == json.dumps(value)  # no whitespace but the grammar's: the bound above holds
    assert set(value) == {"city", "days", "sunny"} and value["city"] in CITIES, value
    assert type(value["days"]) is int and 0 <= value["days"] <= 9 and type(value["sunny"]) is bool
    assert plain.token_ids == arch.alone()[1].token_ids  # the plain row is untouched


def test_prefix_caching_on_equals_off(arch: Arch) -> None:
    first, second = _prefix_prompts()

    def run(engine: Engine):
        return [engine.generate_sync(p, GREEDY) for p in (first, second)]

    on, off = run(arch.engine()), run(arch.engine(enable_prefix_caching=False))
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    assert on[1].usage.cached_tokens > 0 and off[1].usage.cached_tokens == 0  # the second really reused the prefix


def test_attention_is_routed_through_the_blocks(arch: Arch) -> None:
    arch.alone()  # (the engine's worker exists once it has run)
    assert not arch.engine()._core.runner.gathered  # noqa: SLF001
