"""The process's environment: the only module of the package that reads environment variables.

The variables of the whole process (the cache folder, the engines' JSON config, the compilers)
and the readers the settings use for their own variables' text."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

ENGINE_CONFIG_ENV = "MLX_PARALLM_ENGINE_CONFIG"
HOME_ENV = "MLX_PARALLM_HOME"
OPENBLAS_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"
MARCH_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}"
"""What an ``-march`` value may look like (it goes on a compiler's command line)."""

PROCESS_VARIABLES = {
    HOME_ENV: "the cache folder: converted models (``models/``) and built kernels (``kernels/``); "
              "default ``~/.cache/mlx-parallm``.",
    ENGINE_CONFIG_ENV: "a JSON object of EngineConfig fields (``device`` a nested object of DeviceConfig "
                       "fields), e.g. ``{\"max_num_seqs\": 32, \"device\": {\"cpu_kernels\": false}}``: the "
                       "config of engines made without one (every engine of a LiteLLM proxy).",
    "CC": "the C compiler the kernels are built with (default ``cc``).",
    "CXX": "the C++ compiler the MLX extension is built with (default ``c++``).",
    "CUDA_HOME": "MLX's own (or ``CUDA_PATH``): the CUDA toolkit whose ``include/`` its CUDA backend compiles "
                 "kernels against where NVIDIA's runtime package is not installed beside it; ``mlx-parallm doctor`` "
                 "says which headers it will find.",
    OPENBLAS_TIMEOUT_ENV: "OpenBLAS's own variable; set to 4 before OpenBLAS loads unless already set "
                          "(its threads then sleep at once after a call instead of spinning).",
}
"""Variables read by the whole process, not a field of a config (the reference lists them)."""

TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_text(name: str) -> str:
    """Environment variable ``name``, stripped ("" when unset)."""
    return os.environ.get(name, "").strip()


def env_choice(name: str) -> Optional[bool]:
    """Environment variable ``name`` as a yes / no: True for 1 / true / yes / on, False for
    0 / false / no / off (any case), None when unset or anything else."""
    value = env_text(name).lower()
    return True if value in TRUE_WORDS else False if value in FALSE_WORDS else None


def cache_home() -> Path:
    """The cache folder (``$MLX_PARALLM_HOME`` or ``~/.cache/mlx-parallm``), read at each call."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "mlx-parallm")


def c_compiler() -> str:
    """The C compiler for the kernels: ``$CC``, else ``cc``."""
    return os.environ.get("CC") or "cc"


def cxx_compiler() -> str:
    """The C++ compiler for the MLX extension: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX") or "c++"


def cuda_toolkit() -> Optional[str]:
    """The CUDA toolkit folder MLX's CUDA backend is told of: ``$CUDA_HOME``, else ``$CUDA_PATH``, else None."""
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or None


def child_environment(**overrides: str) -> dict[str, str]:
    """This process's environment with ``overrides``, for a child process (benchmarks)."""
    return {**os.environ, **overrides}


def default_environment(name: str, value: str) -> None:
    """Set environment variable ``name`` for libraries that read it (OpenBLAS) unless the
    user set it."""
    os.environ.setdefault(name, value)

