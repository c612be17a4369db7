"""Model loading, the device backends and the CPU kernels.

Every module here imports mlx, which binds its BLAS when it first loads, so importing this
subpackage first loads the process's BLAS (:func:`.device.preload_blas`, from
:attr:`.DeviceConfig.blas`'s default): the package does it on first use, not at import.
"""

from .device import preload_blas as _preload_blas

_preload_blas()
