"""Two engines of one process with different device settings: each model gets the backend its
own EngineConfig.device asks for, and both answer as mlx-lm does."""

from __future__ import annotations

import pytest

from engine_helpers import mlx_lm_greedy
from mlx_parallm_provider import DeviceConfig, EngineConfig, InvalidParameterError, SamplingParams, get_engine, shutdown_engines
from mlx_parallm_provider.engine import Engine
from mlx_parallm_provider.models import backends
from mlx_parallm_provider.models.backends import CPUKernels, MLXOps

PROMPTS = [[1, 5, 9, 14], [1, 7], [1, 30, 31, 32, 33, 34]]


def test_two_engines_with_different_device_settings_each_run_their_own(tiny_model_dir, tiny_model) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    mlx_ops = Engine(str(tiny_model_dir), EngineConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                       device=DeviceConfig(cpu_kernels=False)))
    kernels = Engine(str(tiny_model_dir), EngineConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                       device=DeviceConfig(cpu_kernels=True, small_batch_rows=2, attention_threads=1,
                                                                           qmatmul_threads=1, int8_matmul=0)))
    try:
        assert mlx_ops._loaded is not kernels._loaded  # one model each: its backend is its own
        first, second = backends.of(mlx_ops._loaded.model), backends.of(kernels._loaded.model)
        assert type(first) is MLXOps
        assert isinstance(second, CPUKernels)
        assert (second.packed_rows, second.attention_threads, second.qmatmul_threads, second.int8_matmul) == (2, 1, 1, False)
        assert second.device == kernels.config.device
        expected = mlx_lm_greedy(tiny_model, PROMPTS, params)
        assert [c.token_ids for c in mlx_ops.generate_many_sync(PROMPTS, params)] == expected
        assert [c.token_ids for c in kernels.generate_many_sync(PROMPTS, params)] == expected
    finally:
        mlx_ops.shutdown()
        kernels.shutdown()


def test_get_engine_sees_device_settings(tiny_model_dir) -> None:
    shutdown_engines()
    name = str(tiny_model_dir)
    try:
        config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, device=DeviceConfig(cpu_kernels=False))
        engine = get_engine(name, config)
        assert get_engine(name, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, device=DeviceConfig(cpu_kernels=False))) is engine
        with pytest.raises(InvalidParameterError, match="another config"):
            get_engine(name, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, device=DeviceConfig(cpu_kernels=True)))
    finally:
        shutdown_engines()


def test_quantized_layers_follow_each_models_device_settings(tiny_model_dir, tiny_model) -> None:
    """One quantized checkpoint prepared for two device configs in one process: packed-weight
    layers where small_batch_rows > 0, plain dequantized ones where it is 0; both engines answer alike."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm

    from mlx_parallm_provider.models import backend, qmatmul, small_batch
    from mlx_parallm_provider.models.registry import LoadedModel

    if qmatmul.load() is None or not backend.is_cpu():
        pytest.skip("needs the CPU device and a C compiler")
    prepared = {}
    for rows in (0, 4):
        model, _ = mlx_lm.load(str(tiny_model_dir))
        nn.quantize(model, group_size=32, bits=8)
        mx.eval(model.parameters())
        device = DeviceConfig(cpu_kernels=True, small_batch_rows=rows, int8_matmul=0)
        backend.prepare_model(model, dequantize=True, device=device)
        prepared[rows] = (model, device)
    kinds = {rows: {type(m) for _, m in model.named_modules()} for rows, (model, _) in prepared.items()}
    assert small_batch.SmallBatchLinear not in kinds[0] and small_batch.SmallBatchLinear in kinds[4]
    assert backends.of(prepared[0][0]).packed_rows == 0 and backends.of(prepared[4][0]).packed_rows == 4
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = []
    for rows, (model, device) in prepared.items():
        loaded = LoadedModel(tiny_model.name, tiny_model.path, model, tiny_model.tokenizer, tiny_model.config)
        engine = Engine("tiny", EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, device=device), loaded=loaded)
        try:
            tokens.append([c.token_ids for c in engine.generate_many_sync(PROMPTS, params)])
        finally:
            engine.shutdown()
    assert tokens[0] == tokens[1]
