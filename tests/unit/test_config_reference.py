"""docs/configuration.md is what the generator makes of EngineConfig and DeviceConfig, and
every field has a description, allowed values and, where it has one, its variable."""

from __future__ import annotations

from dataclasses import fields

import pytest

from mlx_parallm_provider import config_reference
from mlx_parallm_provider.config import DEVICE_SETTINGS, ENGINE_SETTINGS, PROCESS_VARIABLES, DeviceConfig, EngineConfig


@pytest.mark.parametrize("cls", [EngineConfig, DeviceConfig])
def test_every_field_has_a_description(cls: type) -> None:
    docs = config_reference.attribute_docs(cls)
    missing = [f.name for f in fields(cls) if not docs.get(f.name, "").strip()]
    assert missing == [], f"{cls.__name__} fields without a description in its docstring's Attributes section: {missing}"
    assert set(docs) <= {f.name for f in fields(cls)}, "the Attributes section describes fields that do not exist"


def test_every_field_has_its_limits_in_one_table() -> None:
    assert set(ENGINE_SETTINGS) == {f.name for f in fields(EngineConfig)} - {"device"}
    assert set(DEVICE_SETTINGS) == {f.name for f in fields(DeviceConfig)}


def test_the_device_limits_are_the_kernels() -> None:
    from mlx_parallm_provider.models import attention, qmatmul
    from mlx_parallm_provider.models.backends import cpu_kernels

    assert DEVICE_SETTINGS["small_batch_rows"].limit.maximum == qmatmul.MAX_ROWS
    assert DEVICE_SETTINGS["attention_threads"].limit.maximum == attention.MAX_THREADS
    assert DEVICE_SETTINGS["qmatmul_threads"].limit.maximum == cpu_kernels.MAX_QMATMUL_THREADS


def test_the_reference_lists_every_field_and_variable() -> None:
    text = config_reference.render()
    for f in fields(EngineConfig):
        assert f"| `{f.name}` |" in text
    for f in fields(DeviceConfig):
        assert f"| `device.{f.name}` |" in text
    for setting in (*ENGINE_SETTINGS.values(), *DEVICE_SETTINGS.values()):
        if setting.env:
            assert f"`{setting.env}`" in text
    for name in PROCESS_VARIABLES:
        assert f"| `{name}` |" in text


def test_docs_configuration_md_is_up_to_date() -> None:
    assert config_reference.DOC_PATH.read_text() == config_reference.render(), (
        f"docs/configuration.md is stale: run {config_reference.COMMAND}")
