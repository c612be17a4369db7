"""GGUF conversion of K-quant / Q5 / BF16 tensors, Llama 3 rope_freqs, Gemma 3 and SentencePiece.

Tiny random GGUFs written byte for byte (gguf-py cannot quantize K-types): the converted
weights must equal gguf-py's own dequantization (exact types: to float16 rounding of their
scales; re-quantized types: within one step of the new grid), and the engine's greedy output
must equal mlx-lm's model built from gguf-py's dequantized weights.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import numpy as np
import pytest

from gguf_quant_fixtures import byte_level_vocab, random_tensor, sentencepiece_vocab, write_gguf
from mlx_parallm_provider.errors import ModelLoadError, UnsupportedModelError
from mlx_parallm_provider.models.gguf import convert_gguf
from mlx_parallm_provider.models.gguf import tensors as gguf_tensors
from mlx_parallm_provider.models.gguf.architectures import ARCHITECTURES, hf_name, unpermute_rows
from mlx_parallm_provider.models.gguf.reader import GGUFFile

HIDDEN, FFN, HEADS, KV_HEADS = 256, 512, 4, 2
LLAMA_LAYER_TYPES = [  # one layer of every exact type, one with Q6_K / floats
    {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q4_0", "attn_output": "Q4_1", "ffn_gate": "Q5_0", "ffn_up": "Q5_1", "ffn_down": "Q8_0"},
    {"attn_q": "Q6_K", "attn_k": "BF16", "attn_v": "F16", "attn_output": "Q4_K", "ffn_gate": "Q5_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
]


def _llama3_rope_freqs(base: float, dims: int, factor: float = 32.0, low: float = 1.0, high: float = 4.0, length: int = 8192) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's rope_freqs for Llama 3 (LlamaModel.generate_extra_tensors)."""
    out = []
    for freq in 1.0 / base ** (np.arange(0, dims, 2) / dims):
        wavelen = 2 * math.pi / freq
        if wavelen < length / high:
            out.append(1.0)
        elif wavelen > length / low:
            out.append(factor)
        else:
            smooth = (length / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _layers(rng, shapes: dict[str, tuple[int, int]], types: list[dict[str, str]], norms: dict[str, int], scale: float) -> dict:
    tensors = {}
    for i, layer in enumerate(types):
        for name, kind in layer.items():
            tensors[f"blk.{i}.{name}.weight"] = random_tensor(kind, shapes[name], rng, scale)
        for name, size in norms.items():
            tensors[f"blk.{i}.{name}.weight"] = (1 + 0.1 * rng.standard_normal(size)).astype(np.float32), None
    return tensors


@pytest.fixture(scope="session")
def llama3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(7)
    head_dim, vocab = HIDDEN // HEADS, byte_level_vocab()
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN), "attn_v": (KV_HEADS * head_dim, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    tensors = _layers(rng, shapes, LLAMA_LAYER_TYPES, {"attn_norm": HIDDEN, "ffn_norm": HIDDEN}, 0.3)
    tensors["token_embd.weight"] = random_tensor("Q4_K", (len(vocab["tokens"]), HIDDEN), rng, 1.0)
    tensors["output.weight"] = random_tensor("Q6_K", (len(vocab["tokens"]), HIDDEN), rng, 1.0)
    tensors["output_norm.weight"] = np.ones(HIDDEN, np.float32), T.F32
    tensors["rope_freqs.weight"] = _llama3_rope_freqs(500000.0, head_dim), T.F32
    header = {"embedding_length": HIDDEN, "block_count": 2, "feed_forward_length": FFN, "attention.head_count": HEADS,
              "attention.head_count_kv": KV_HEADS, "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 500000.0,
              "context_length": 1024, "rope.dimension_count": head_dim}
    return write_gguf(tmp_path_factory.mktemp("llama3") / "llama3-kquant.gguf", "llama", header, vocab, tensors)


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(3)
    heads, head_dim, vocab = 2, 128, sentencepiece_vocab()
    shapes = {"attn_q": (heads * head_dim, HIDDEN), "attn_k": (head_dim, HIDDEN), "attn_v": (head_dim, HIDDEN),
              "attn_output": (HIDDEN, heads * head_dim), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    types = [dict(zip(shapes, ["Q5_0", "Q5_0", "Q8_0", "Q4_K", "Q5_0", "Q5_0", "Q6_K" if i % 2 else "Q4_K"])) for i in range(6)]
    norms = {"attn_norm": HIDDEN, "post_attention_norm": HIDDEN, "ffn_norm": HIDDEN, "post_ffw_norm": HIDDEN,
             "attn_q_norm": head_dim, "attn_k_norm": head_dim}
    tensors = _layers(rng, shapes, types, norms, 0.3)
    tensors["token_embd.weight"] = random_tensor("Q8_0", (len(vocab["tokens"]), HIDDEN), rng, 0.2)
    tensors["output_norm.weight"] = np.full(HIDDEN, 3.0, np.float32), T.F32
    header = {"embedding_length": HIDDEN, "block_count": 6, "feed_forward_length": FFN, "attention.head_count": heads,
              "attention.head_count_kv": 1, "attention.key_length": head_dim, "attention.value_length": head_dim,
              "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1000000.0, "context_length": 1024,
              "attention.sliding_window": 8}
    return write_gguf(tmp_path_factory.mktemp("gemma3") / "gemma3-tiny.gguf", "gemma3", header, vocab, tensors)


def _shapes(heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple[int, int]]:
    return {"attn_q": (heads * head_dim, HIDDEN), "attn_k": (kv_heads * head_dim, HIDDEN), "attn_v": (kv_heads * head_dim, HIDDEN),
            "attn_output": (HIDDEN, heads * head_dim), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}


# Q4_K_M's mix (Q4_K, with Q6_K for attn_v / ffn_down), then a layer of other types.
QWEN_LAYER_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q8_0", "attn_k": "Q5_0", "attn_v": "Q5_K", "attn_output": "BF16", "ffn_gate": "Q4_0", "ffn_up": "Q5_1", "ffn_down": "F16"},
]


def _write_qwen2(path: Path, header_extra: dict | None = None) -> Path:
    """Qwen 2 / 2.5: NeoX RoPE (rows as in Hugging Face), Q / K / V biases, tied embeddings."""
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(11)
    head_dim, vocab = HIDDEN // HEADS, {**byte_level_vocab(), "pre": "qwen2"}
    tensors = _layers(rng, _shapes(HEADS, KV_HEADS, head_dim), QWEN_LAYER_TYPES, {"attn_norm": HIDDEN, "ffn_norm": HIDDEN}, 0.3)
    for i in range(len(QWEN_LAYER_TYPES)):
        for name, rows in (("attn_q", HEADS * head_dim), ("attn_k", KV_HEADS * head_dim), ("attn_v", KV_HEADS * head_dim)):
            tensors[f"blk.{i}.{name}.bias"] = (0.5 * rng.standard_normal(rows)).astype(np.float32), T.F32
    tensors["token_embd.weight"] = random_tensor("Q4_K", (len(vocab["tokens"]), HIDDEN), rng, 1.0)
    tensors["output_norm.weight"] = np.ones(HIDDEN, np.float32), T.F32
    header = {"embedding_length": HIDDEN, "block_count": 2, "feed_forward_length": FFN, "attention.head_count": HEADS,
              "attention.head_count_kv": KV_HEADS, "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1000000.0,
              "context_length": 32768}
    return write_gguf(path, "qwen2", {**header, **(header_extra or {})}, vocab, tensors)


@pytest.fixture(scope="session")
def qwen2_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_qwen2(tmp_path_factory.mktemp("qwen2") / "qwen2-tiny.gguf")


# Qwen2.5's YaRN as llama.cpp's converter writes it: 4x its original 32768 tokens.
YARN_HEADER = {"context_length": 131072, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
               "rope.scaling.original_context_length": 32768}


@pytest.fixture(scope="session")
def qwen2_yarn_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_qwen2(tmp_path_factory.mktemp("qwen2-yarn") / "qwen2-yarn-tiny.gguf", YARN_HEADER)


@pytest.fixture(scope="session")
def qwen3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen 3: per-head Q / K RMSNorms, a head size given by key_length, an output matrix."""
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(13)
    heads, head_dim, vocab = 8, 64, {**byte_level_vocab(), "pre": "qwen2"}
    norms = {"attn_norm": HIDDEN, "ffn_norm": HIDDEN, "attn_q_norm": head_dim, "attn_k_norm": head_dim}
    tensors = _layers(rng, _shapes(heads, KV_HEADS, head_dim), QWEN_LAYER_TYPES[::-1], norms, 0.3)
    tensors["token_embd.weight"] = random_tensor("Q8_0", (len(vocab["tokens"]), HIDDEN), rng, 1.0)
    tensors["output.weight"] = random_tensor("Q6_K", (len(vocab["tokens"]), HIDDEN), rng, 1.0)
    tensors["output_norm.weight"] = np.ones(HIDDEN, np.float32), T.F32
    header = {"embedding_length": HIDDEN, "block_count": 2, "feed_forward_length": FFN, "attention.head_count": heads,
              "attention.head_count_kv": KV_HEADS, "attention.key_length": head_dim, "attention.value_length": head_dim,
              "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1000000.0, "context_length": 40960}
    return write_gguf(tmp_path_factory.mktemp("qwen3") / "qwen3-tiny.gguf", "qwen3", header, vocab, tensors)


def _write_phi3(path: Path, header_extra: dict | None = None, tensors_extra: dict | None = None) -> Path:
    """Phi-3 (mini-4k): fused Q / K / V rows and fused gate / up rows, SentencePiece."""
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(17)
    head_dim, vocab = HIDDEN // HEADS, sentencepiece_vocab()
    shapes = {"attn_qkv": ((HEADS + 2 * KV_HEADS) * head_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_up": (2 * FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
    types = [dict(zip(shapes, ["Q4_K", "Q5_K", "Q4_K", "Q6_K"])), dict(zip(shapes, ["Q8_0", "Q4_1", "F16", "Q5_0"]))]
    tensors = _layers(rng, shapes, types, {"attn_norm": HIDDEN, "ffn_norm": HIDDEN}, 0.3)
    tensors["token_embd.weight"] = random_tensor("Q4_K", (len(vocab["tokens"]), HIDDEN), rng, 1.0)
    tensors["output.weight"] = random_tensor("Q6_K", (len(vocab["tokens"]), HIDDEN), rng, 1.0)
    tensors["output_norm.weight"] = np.ones(HIDDEN, np.float32), T.F32
    header = {"embedding_length": HIDDEN, "block_count": 2, "feed_forward_length": FFN, "attention.head_count": HEADS,
              "attention.head_count_kv": KV_HEADS, "attention.layer_norm_rms_epsilon": 1e-5, "rope.freq_base": 10000.0,
              "context_length": 4096, "rope.dimension_count": head_dim, "rope.scaling.original_context_length": 4096}
    return write_gguf(path, "phi3", {**header, **(header_extra or {})}, vocab, {**tensors, **(tensors_extra or {})})


@pytest.fixture(scope="session")
def phi3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_phi3(tmp_path_factory.mktemp("phi3") / "phi3-tiny.gguf")


def _longrope_factors(rotary: int) -> tuple[np.ndarray, np.ndarray]:
    """Phi-3.5-mini-like LongRoPE factors: short ones near 1, long ones rising to ~40."""
    i = np.arange(rotary // 2, dtype=np.float32)
    return (1 + 40 * (i / i[-1]) ** 2).astype(np.float32), (1 + 0.1 * i / i[-1]).astype(np.float32)


LONGROPE_HEADER = {"context_length": 131072, "rope.scaling.attn_factor": math.sqrt(1 + math.log(32) / math.log(4096))}


def _longrope_tensors(head_dim: int) -> dict:
    from gguf import GGMLQuantizationType as T

    long, short = _longrope_factors(head_dim)
    return {"rope_factors_long.weight": (long, T.F32), "rope_factors_short.weight": (short, T.F32)}


@pytest.fixture(scope="session")
def phi3_longrope_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Phi-3.5-mini's shape of LongRoPE: a 131072-token context over an original 4096, the
    factors as llama.cpp's converter writes them (``rope_factors_long`` / ``_short``)."""
    path = tmp_path_factory.mktemp("phi3-longrope") / "phi3-longrope-tiny.gguf"
    return _write_phi3(path, LONGROPE_HEADER, _longrope_tensors(HIDDEN // HEADS))


def _reference_weights(path: Path) -> tuple[dict, dict]:
    """gguf-py's dequantization of every weight, renamed / un-permuted / un-offset as mlx-lm wants."""
    import mlx.core as mx

    gguf = GGUFFile(path)
    arch = gguf.metadata["general.architecture"]
    spec = ARCHITECTURES[arch]
    heads = {"attn_q": gguf.metadata[f"{arch}.attention.head_count"], "attn_k": gguf.metadata[f"{arch}.attention.head_count_kv"]}
    out, kinds = {}, {}
    for name, info in gguf.tensors.items():
        target = hf_name(gguf, spec, name)
        if target is None:
            continue
        raw = gguf.data(info)
        w = raw.view(np.float32).reshape(info.shape) if info.type_name == "F32" else gguf_tensors.dequantize(info.type_name, info.shape, raw)
        part = name.split(".")[-2]
        if spec.permute_qk and part in heads:
            w = np.array(unpermute_rows(gguf, name, mx.array(w), heads[part], w.shape[0] // heads[part]))
        if spec.norm_offset and name.endswith("norm.weight"):
            w = w - spec.norm_offset
        out[target], kinds[target] = w.astype(np.float32), info.type_name
    return out, kinds


def _converted_weights(folder: Path) -> dict:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm
    from mlx.utils import tree_flatten

    model, _ = mlx_lm.load(str(folder))
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            f32 = mx.dequantize(module.weight, module.scales.astype(mx.float32), module.biases.astype(mx.float32),
                                group_size=module.group_size, bits=module.bits)
            out[f"{name}.weight"] = np.array(f32)
    for name, value in tree_flatten(model.parameters()):
        if not name.endswith((".scales", ".biases")) and name not in out:
            out[name] = np.array(value.astype(mx.float32))
    return out


def _check_weights(path: Path, folder: Path) -> None:
    reference, kinds = _reference_weights(path)
    converted = _converted_weights(folder)
    assert set(converted) == set(reference)
    for name, ref in reference.items():
        got, kind = converted[name], kinds[name]
        err = np.abs(got - ref)
        if kind in gguf_tensors.REQUANTIZED:
            assert _within_requantization_error(got, ref, gguf_tensors.REQUANTIZED[kind]), (name, kind)
        elif kind in ("Q4_K", "Q5_K"):  # sub-block scales d * sc rounded to float16
            assert err.max() <= 2**-10 * np.abs(ref).max(), (name, kind, err.max())
        else:  # Q4_0 .. Q8_0 scales are float16 already; floats are copied
            assert err.max() == 0, (name, kind, err.max())


def _within_requantization_error(got: np.ndarray, ref: np.ndarray, bits: int) -> bool:
    """Group by group: one step of the new grid, plus the float16 rounding of its scale
    (times the largest code) and bias (measured: 1.07 steps at most for Q6_K -> 8 bits)."""
    groups = ref.reshape(-1, 32)
    step = (groups.max(1) - groups.min(1)) / (2**bits - 1)
    bound = step * (1 + 2**-11 * (2**bits - 1)) + 2**-11 * np.abs(groups).max(1)
    return bool((np.abs(got.reshape(-1, 32) - groups).max(1) <= bound * 1.01).all())


def _mlx_lm_greedy(path: Path, folder: Path, prompt: list[int], n: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization"), config.pop("quantization_config")
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    weights = {k: mx.array(v) for k, v in _reference_weights(path)[0].items()}
    sanitize = getattr(model, "sanitize", lambda w: w)  # phi3 has none
    model.load_weights(list(sanitize(weights).items()))
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda logits: mx.argmax(logits, axis=-1))
    return [int(token) for token, _ in steps]


@pytest.mark.parametrize("fixture", ["llama3_gguf", "gemma3_gguf", "qwen2_gguf", "qwen3_gguf", "phi3_gguf", "phi3_longrope_gguf", "qwen2_yarn_gguf"])
def test_weights_equal_gguf_py_dequantization_and_greedy_equals_mlx_lm(fixture, request, tmp_path: Path) -> None:
    from mlx_parallm_provider import Engine, SamplingParams

    path = request.getfixturevalue(fixture)
    folder = convert_gguf(path, tmp_path / "converted")
    _check_weights(path, folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"]["group_size"] == 32

    engine = Engine(str(path))
    try:
        prompt = engine.encode("the cat sat on the mat, the cat sat")
        expected = _mlx_lm_greedy(path, folder, prompt, 12)
        done = engine.generate_sync(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    finally:
        engine.shutdown()
    assert done.token_ids == expected


def test_llama3_rope_freqs_become_llama3_rope_scaling(llama3_gguf: Path, tmp_path: Path) -> None:
    config = json.loads((convert_gguf(llama3_gguf, tmp_path / "out") / "config.json").read_text())
    scaling = config["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 32.0
    assert (scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["original_max_position_embeddings"]) == (1.0, 4.0, 8192)
    assert config["quantization"]["lm_head"] == {"group_size": 32, "bits": 8}  # Q6_K re-quantized to 8 bits


def test_phi3_longrope_factors_become_its_rope_scaling(phi3_longrope_gguf: Path, tmp_path: Path) -> None:
    config = json.loads((convert_gguf(phi3_longrope_gguf, tmp_path / "out") / "config.json").read_text())
    long, short = _longrope_factors(HIDDEN // HEADS)
    scaling = config["rope_scaling"]
    assert scaling["type"] == "longrope" and scaling["long_factor"] == long.tolist() and scaling["short_factor"] == short.tolist()
    assert (config["max_position_embeddings"], config["original_max_position_embeddings"]) == (131072, 4096)


def test_phi3_longrope_with_factors_mlx_lm_cannot_apply_is_refused(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType as T

    odd = _write_phi3(tmp_path / "odd.gguf", {**LONGROPE_HEADER, "rope.scaling.attn_factor": 1.5}, _longrope_tensors(HIDDEN // HEADS))
    with pytest.raises(UnsupportedModelError, match="attention factor 1.5"):
        convert_gguf(odd, tmp_path / "out")
    wrong = {**_longrope_tensors(HIDDEN // HEADS), "rope_factors_long.weight": (np.ones(5, np.float32), T.F32)}  # not half the rotary dims
    with pytest.raises(ModelLoadError, match="rope_factors_long"):
        convert_gguf(_write_phi3(tmp_path / "short.gguf", LONGROPE_HEADER, wrong), tmp_path / "out2")


def test_yarn_becomes_the_rope_scaling_mlx_lm_reads(qwen2_yarn_gguf: Path, tmp_path: Path) -> None:
    config = json.loads((convert_gguf(qwen2_yarn_gguf, tmp_path / "out") / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "yarn", "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                      "beta_fast": 32.0, "beta_slow": 1.0}
    assert config["max_position_embeddings"] == 131072


@pytest.mark.parametrize("key, value", [("rope.scaling.yarn_log_multiplier", 0.1), ("rope.scaling.attn_factor", 0.7),
                                        ("rope.scaling.type", "longrope-ish")])
def test_rope_scaling_mlx_lm_cannot_apply_is_refused_naming_it(key: str, value, tmp_path: Path) -> None:
    path = _write_qwen2(tmp_path / "odd.gguf", {**YARN_HEADER, key: value})
    with pytest.raises(UnsupportedModelError, match=key.rsplit(".", 1)[-1] if key != "rope.scaling.type" else "longrope-ish"):
        convert_gguf(path, tmp_path / "out")


def test_gemma3_config_and_sentencepiece_tokenizer(gemma3_gguf: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = convert_gguf(gemma3_gguf, tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["head_dim"] == 128 and config["query_pre_attn_scalar"] == 128
    assert (config["sliding_window"], config["sliding_window_pattern"], config["rope_local_base_freq"]) == (8, 6, 10000.0)
    assert config["eos_token_id"] == [1, 5]  # <eos> and <end_of_turn>
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer.encode("the cat sat")
    assert ids[0] == 2 and tokenizer.decode(ids, skip_special_tokens=True) == "the cat sat"
    assert tokenizer.convert_ids_to_tokens(ids[1:]) == ["th", "e", "▁cat", "▁sat"]  # no prefix space, as Gemma
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.encode("<start_of_turn>", add_special_tokens=False) == [4]


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K"])
def test_low_bit_k_quants_are_requantized_within_one_step(kind: str) -> None:
    rng = np.random.default_rng(1)
    raw, _ = random_tensor(kind, (16, 512), rng, 0.5)
    arrays, bits = gguf_tensors.convert(kind, (16, 512), raw)
    import mlx.core as mx

    got = np.array(mx.dequantize(arrays["weight"], arrays["scales"].astype(mx.float32), arrays["biases"].astype(mx.float32), group_size=32, bits=bits))
    assert bits == 4 and _within_requantization_error(got, gguf_tensors.dequantize(kind, (16, 512), raw), bits)


def test_unsupported_tensor_type_names_it(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (rng.integers(0, 255, (262, 136), dtype=np.uint8), T.IQ4_XS),
               "output_norm.weight": (np.ones(HIDDEN, np.float32), T.F32)}
    path = write_gguf(tmp_path / "iq.gguf", "llama", {"embedding_length": HIDDEN, "block_count": 1, "feed_forward_length": FFN,
                      "attention.head_count": HEADS}, byte_level_vocab(), tensors)
    with pytest.raises(UnsupportedModelError, match=r"tensor type IQ4_XS is not supported \(supported: F32, F16, BF16, Q4_0"):
        convert_gguf(path, tmp_path / "out")
