"""``mlx-parallm bench``: a serving benchmark with vLLM's metrics, this package's front doors
and its peers side by side (see :mod:`.command`).

One job per module: :mod:`.workloads` (what is sent), :mod:`.arrivals` (when),
:mod:`.runners` (to which system), :mod:`.metrics` (the arithmetic), :mod:`.sweep`,
:mod:`.report` (table, JSON) and :mod:`.plots` (PNG). :mod:`.cpu_backend` is a separate
micro-benchmark of MLX's CPU backend (BLAS x dequantized weights); :mod:`.gpu`, the GPU checks
that are not tests (``python -m mlx_parallm_provider.bench.gpu``).
"""
