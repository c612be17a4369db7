"""EngineConfig.from_env: how a LiteLLM proxy replica's engines are sized."""

from __future__ import annotations

import pytest

from mlx_parallm_provider import EngineConfig, InvalidParameterError


def test_unset_means_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLX_PARALLM_ENGINE_CONFIG", raising=False)
    assert EngineConfig.from_env() == EngineConfig()


def test_json_fields_override_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_PARALLM_ENGINE_CONFIG", '{"max_num_seqs": 8, "prefix_cache_memory_gb": 0.5}')
    config = EngineConfig.from_env()
    assert (config.max_num_seqs, config.prefix_cache_memory_gb, config.max_queue) == (8, 0.5, EngineConfig().max_queue)


@pytest.mark.parametrize("raw, field", [
    ("{not json", "is not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"max_num_seq": 8}', "unknown EngineConfig fields ['max_num_seq']"),
    ('{"max_num_seqs": 0}', "max_num_seqs"),
    ('{"stream_interval": 0}', "stream_interval"),
])
def test_bad_values_are_named(monkeypatch: pytest.MonkeyPatch, raw: str, field: str) -> None:
    monkeypatch.setenv("MLX_PARALLM_ENGINE_CONFIG", raw)
    with pytest.raises(InvalidParameterError, match=field.replace("[", r"\[").replace("]", r"\]")):
        EngineConfig.from_env()
