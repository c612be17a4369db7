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


# -- DeviceConfig: each MLX_PARALLM_* variable is the default of one field -------------------

from mlx_parallm_provider import DeviceConfig  # noqa: E402
from mlx_parallm_provider.config import DEVICE_SETTINGS, ENGINE_SETTINGS  # noqa: E402

_VARIABLES = [s.env for s in (*DEVICE_SETTINGS.values(), *ENGINE_SETTINGS.values()) if s.env]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in [*_VARIABLES, "MLX_PARALLM_ENGINE_CONFIG"]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("variable, raw, field, value", [
    ("MLX_PARALLM_CPU_OPS", "0", "cpu_kernels", False),
    ("MLX_PARALLM_CPU_OPS", "on", "cpu_kernels", True),
    ("MLX_PARALLM_BLAS", "off", "blas", "off"),
    ("MLX_PARALLM_BLAS", "none", "blas", "off"),
    ("MLX_PARALLM_BLAS", "/opt/libblas.so", "blas", "/opt/libblas.so"),
    ("MLX_PARALLM_SMALL_BATCH_ROWS", "0", "small_batch_rows", 0),
    ("MLX_PARALLM_SMALL_BATCH_ROWS", "999", "small_batch_rows", 64),  # clamped, warned
    ("MLX_PARALLM_QMATMUL_THREADS", "3", "qmatmul_threads", 3),
    ("MLX_PARALLM_ATTENTION_THREADS", "abc", "attention_threads", None),  # not an integer: the default, warned
    ("MLX_PARALLM_INT8_MATMUL", "1", "int8_matmul", 8),
    ("MLX_PARALLM_INT8_MATMUL", "16", "int8_matmul", 16),
    ("MLX_PARALLM_INT8_MATMUL", "off", "int8_matmul", 0),
    ("MLX_PARALLM_FLOAT32_WEIGHTS", "1", "float32_weights", True),
    ("MLX_PARALLM_KERNEL_MARCH", "x86-64-v3", "kernel_march", "x86-64-v3"),
    ("MLX_PARALLM_KERNEL_MARCH", "native", "kernel_march", None),
    ("MLX_PARALLM_KERNEL_MARCH", "v3; rm -rf /", "kernel_march", None),  # not an -march name: the default, warned
    ("MLX_PARALLM_AMX", "0", "amx", False),
])
def test_a_variable_is_its_fields_default(clean_env: pytest.MonkeyPatch, variable: str, raw: str, field: str, value) -> None:
    assert getattr(DeviceConfig(), field) == DEVICE_SETTINGS[field].default  # unset: the built-in default
    clean_env.setenv(variable, raw)
    assert getattr(DeviceConfig(), field) == value
    assert getattr(EngineConfig().device, field) == value
    assert getattr(DeviceConfig.from_env(), field) == value


def test_an_explicit_field_wins_over_its_variable(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MLX_PARALLM_CPU_OPS", "0")
    clean_env.setenv("MLX_PARALLM_SMALL_BATCH_ROWS", "2")
    clean_env.setenv("MLX_PARALLM_DEQUANTIZE", "1")
    device = DeviceConfig(cpu_kernels=True)
    assert (device.cpu_kernels, device.small_batch_rows) == (True, 2)  # the other field still from its variable
    assert EngineConfig().dequantize is True and EngineConfig(dequantize=False).dequantize is False
    assert EngineConfig(device=DeviceConfig(small_batch_rows=0)).device.small_batch_rows == 0


def test_a_bad_variable_is_warned_about_not_raised(clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    clean_env.setenv("MLX_PARALLM_INT8_MATMUL", "sixteen")
    with caplog.at_level("WARNING"):
        assert DeviceConfig().int8_matmul is None
    assert "MLX_PARALLM_INT8_MATMUL" in caplog.text


@pytest.mark.parametrize("values, field", [
    ({"cpu_kernels": "yes"}, "cpu_kernels"),
    ({"blas": ""}, "blas"),
    ({"small_batch_rows": 65}, "small_batch_rows"),
    ({"small_batch_rows": -1}, "small_batch_rows"),
    ({"qmatmul_threads": 0}, "qmatmul_threads"),
    ({"attention_threads": 257}, "attention_threads"),
    ({"int8_matmul": 4}, "int8_matmul"),
    ({"int8_matmul": True}, "int8_matmul"),
    ({"float32_weights": 1}, "float32_weights"),
    ({"kernel_march": "x86-64-v3; rm -rf /"}, "kernel_march"),
    ({"amx": None}, "amx"),
])
def test_bad_explicit_device_values_are_named(clean_env: pytest.MonkeyPatch, values: dict, field: str) -> None:
    with pytest.raises(InvalidParameterError, match=f"^{field}:"):
        DeviceConfig(**values)
    with pytest.raises(InvalidParameterError, match=f"^{field}:"):
        EngineConfig(device=values)


def test_engine_config_json_takes_a_nested_device(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MLX_PARALLM_ATTENTION_THREADS", "3")
    clean_env.setenv("MLX_PARALLM_ENGINE_CONFIG", '{"max_num_seqs": 8, "device": {"cpu_kernels": false, "small_batch_rows": 2}}')
    config = EngineConfig.from_env()
    assert config.max_num_seqs == 8
    assert config.device == DeviceConfig(cpu_kernels=False, small_batch_rows=2, attention_threads=3)
    clean_env.setenv("MLX_PARALLM_ENGINE_CONFIG", '{"device": {"cpu_kernel": false}}')
    with pytest.raises(InvalidParameterError, match=r"unknown DeviceConfig fields \['cpu_kernel'\]"):
        EngineConfig.from_env()
    clean_env.setenv("MLX_PARALLM_ENGINE_CONFIG", '{"device": 3}')
    with pytest.raises(InvalidParameterError, match="device"):
        EngineConfig.from_env()


def test_as_dict_is_json_with_a_nested_device_and_round_trips(clean_env: pytest.MonkeyPatch) -> None:
    import json

    config = EngineConfig(max_num_seqs=8, device=DeviceConfig(cpu_kernels=False, int8_matmul=8))
    text = json.dumps(config.as_dict())
    assert json.loads(text)["device"]["int8_matmul"] == 8
    clean_env.setenv("MLX_PARALLM_ENGINE_CONFIG", text)
    assert EngineConfig.from_env() == config


def test_configs_differing_only_in_device_differ(clean_env: pytest.MonkeyPatch) -> None:
    """get_engine compares EngineConfigs: device settings are part of that comparison."""
    assert EngineConfig() == EngineConfig()
    assert EngineConfig(device=DeviceConfig(cpu_kernels=False)) != EngineConfig(device=DeviceConfig(cpu_kernels=True))
    assert hash(DeviceConfig(small_batch_rows=2)) == hash(DeviceConfig(small_batch_rows=2))  # a registry key


def test_only_config_reads_the_environment() -> None:
    """Environment variables are read in config/environment.py alone (bench/ may pass an
    environment on to a subprocess: ``dict(os.environ, ...)``)."""
    import re
    from pathlib import Path

    import mlx_parallm_provider

    root = Path(mlx_parallm_provider.__file__).parent
    readers = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".py", ".c", ".h", ".cpp") or path == root / "config" / "environment.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.environ|getenv", line) and not re.search(r"dict\(os\.environ|\{\*\*os\.environ|\"os\.environ/", line):
                readers.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert readers == []
