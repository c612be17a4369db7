"""EngineConfig, DeviceConfig and PoolConfig: every engine knob, its default and its validation, in one place.

Environment variables only supply defaults, and this package is the only one that reads them (:mod:`.environment`):
each ``MLX_PARALLM_*`` knob is the default of one field (:data:`ENGINE_SETTINGS`,
:data:`DEVICE_SETTINGS`, :data:`POOL_SETTINGS`), and a field given explicitly wins over its variable. A bad value in
the environment is warned about and replaced (a typo in a replica's environment must not fail
every request); a bad explicit value raises :class:`~.errors.InvalidParameterError`.
:func:`cache_home`, :data:`ENGINE_CONFIG_ENV` and the compilers stay process-wide.
``python -m mlx_parallm_provider.config_reference`` prints the reference of it all.
"""

from __future__ import annotations

from .device import DEVICE_SETTINGS, PAGED_ATTENTION, DeviceConfig, default_blas
from .engine import ENGINE_SETTINGS, KV_CACHE_DTYPES, EngineConfig, default_dequantize
from .environment import (
    ENGINE_CONFIG_ENV,
    HOME_ENV,
    MARCH_PATTERN,
    OPENBLAS_TIMEOUT_ENV,
    PROCESS_VARIABLES,
    c_compiler,
    cache_home,
    child_environment,
    cuda_toolkit,
    cxx_compiler,
    default_environment,
    env_choice,
    env_text,
)
from .pool import POOL_SETTINGS, PoolConfig
from .settings import Setting

__all__ = [
    "DEVICE_SETTINGS", "ENGINE_CONFIG_ENV", "ENGINE_SETTINGS", "HOME_ENV", "KV_CACHE_DTYPES", "MARCH_PATTERN",
    "OPENBLAS_TIMEOUT_ENV", "PAGED_ATTENTION", "POOL_SETTINGS", "PROCESS_VARIABLES", "DeviceConfig", "EngineConfig",
    "PoolConfig", "Setting", "c_compiler", "cache_home", "child_environment", "cuda_toolkit", "cxx_compiler", "default_blas",
    "default_dequantize", "default_environment", "env_choice", "env_text",
]
