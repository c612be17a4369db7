"""One backend object per loaded model: MLX's own ops (:class:`MLXOps`), this package's CPU
kernels (:class:`CPUKernels`) or MLX's ops with this package's paged-attention kernels on a GPU
(:class:`GPUKernels`), chosen once (:func:`choose`) and installed on that model alone
(:func:`install`), as vLLM picks one attention backend class per model.

:func:`install` points the model's layers at the backend (:mod:`.routing`: per instance,
never through mlx-lm's module globals) and records it on the model (:func:`of`). A model
nobody installs a backend on (a user's own, the benchmark's mlx-lm peers) runs mlx-lm as it
is, whatever else the process serves.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional, Union

from ...config import DEVICE_SETTINGS, DeviceConfig
from ..device import gpu_platform
from .cpu_kernels import CPUKernels
from .gpu_kernels import GPUKernels
from .mlx_ops import MLXOps
from .routing import route, unroute

__all__ = ["CPU_OPS_ENV", "CPUKernels", "GPUKernels", "MLXOps", "choose", "describe", "ensure", "install", "of", "routes_attention", "uninstall",
           "using", "wants_kernels"]

logger = logging.getLogger(__name__)

CPU_OPS_ENV = DEVICE_SETTINGS["cpu_kernels"].env
_ATTRIBUTE = "_parallm_backend"  # on the model: (backend, whether attention is routed)

Choice = Union[None, bool, str, MLXOps]
"""What :func:`choose` takes: None (the default), True / ``"cpu"`` (the CPU kernels),
False / ``"mlx"`` (MLX's own ops), ``"gpu"`` (the GPU kernels), or a backend object."""


def wants_kernels(device: Optional[DeviceConfig] = None) -> bool:
    """The default choice: ``device.cpu_kernels`` (default :class:`.DeviceConfig`'s, from
    ``MLX_PARALLM_CPU_OPS``) where set, else whether MLX's default device is the CPU."""
    chosen = (device or DeviceConfig()).cpu_kernels
    if chosen is not None:
        return chosen
    from ..device import is_cpu

    return is_cpu()


def choose(choice: Choice = None, device: Optional[DeviceConfig] = None) -> MLXOps:
    """A new backend for one model (see :data:`Choice`), set from ``device`` (default: the
    environment's :class:`.DeviceConfig`). By default: the CPU kernels where
    :func:`wants_kernels`, else the GPU kernels on a GPU, else MLX's ops."""
    if isinstance(choice, MLXOps):
        return choice
    device = device or DeviceConfig()
    if choice is None:
        choice = True if wants_kernels(device) else "gpu" if gpu_platform() else False
    if choice in (True, "cpu"):
        return CPUKernels(device)
    if choice == "gpu":
        return GPUKernels(device)
    if choice in (False, "mlx"):
        return MLXOps()
    raise ValueError(f"unknown backend {choice!r}: expected 'cpu', 'gpu', 'mlx', a bool or a backend object")


def install(model: Any, backend: MLXOps) -> bool:
    """Make ``backend`` the one ``model``'s layers call (replacing any earlier one: the layers
    that hold a backend, :mod:`..fused_ops` and :mod:`..small_batch`'s, switch too). Returns
    whether its attention goes through ``backend.attend``, hence through caches' ``attend``."""
    routed = route(model, backend)
    for _, layer in model.named_modules() if hasattr(model, "named_modules") else ():
        if isinstance(getattr(layer, "backend", None), MLXOps):
            layer.backend = backend
    object.__setattr__(model, _ATTRIBUTE, (backend, routed))
    return routed


def ensure(model: Any, device: Optional[DeviceConfig] = None) -> MLXOps:
    """``model``'s backend, one chosen by default for ``device`` (:func:`choose`) and installed
    where it has none (a model handed to an engine without :func:`..backend.prepare_model`)."""
    backend = of(model)
    if backend is None:
        backend = choose(None, device)
        try:
            install(model, backend)
        except (AttributeError, TypeError):  # an object that takes no attributes: left as it is
            logger.info("%s takes no backend: it runs as it is", type(model).__name__)
    return backend


def uninstall(model: Any) -> None:
    """Give ``model``'s layers back their mlx-lm classes and forget its backend (layers
    replaced at load, :mod:`..fused_ops` and :mod:`..small_batch`'s, stay)."""
    unroute(model)
    if _ATTRIBUTE in vars(model):
        object.__delattr__(model, _ATTRIBUTE)


def of(model: Any) -> Optional[MLXOps]:
    """The backend installed on ``model``, or None (mlx-lm's own code runs)."""
    return getattr(model, _ATTRIBUTE, (None, False))[0]


def routes_attention(model: Any) -> bool:
    """Whether ``model``'s attention goes through its backend, hence through caches' ``attend``
    (what the paged KV and shared prefixes need)."""
    return getattr(model, _ATTRIBUTE, (None, False))[1]


def describe(model: Any) -> dict[str, Optional[str]]:
    """``{"backend": ..., "attention": ...}``: the name of ``model``'s backend (None without
    one) and how its attention reads paged KV, in words (``Engine.stats()``)."""
    backend = of(model)
    if backend is None or not routes_attention(model):
        return {"backend": getattr(backend, "name", None), "attention": "gather (the model's own attention code)"}
    return {"backend": backend.name, "attention": backend.attention_path()}


@contextlib.contextmanager
def using(model: Any, backend: Choice) -> Iterator[MLXOps]:
    """``model`` on another backend inside the block, its own again after (tests, profiles)."""
    previous = of(model)
    chosen = choose(backend)
    install(model, chosen)
    try:
        yield chosen
    finally:
        if previous is None:
            uninstall(model)
        else:
            install(model, previous)
