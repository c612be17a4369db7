"""Importing the package does no work beyond registering with LiteLLM: no mlx / mlx-lm, no
BLAS loaded, no atexit handler; those come on first use, the BLAS just before mlx loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlx_parallm_provider.models import backend

IMPORT_PROBE = """
import atexit, json, logging, sys
before_exit, before_path = atexit._ncallbacks(), list(sys.meta_path)
import mlx_parallm_provider
maps = open("/proc/self/maps").read() if sys.platform.startswith("linux") else ""
print(json.dumps({
    "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "litellm", "numpy")
                      or m.startswith(("mlx_parallm_provider.engine", "mlx_parallm_provider.models"))),
    "openblas": "openblas" in maps.lower(),
    "atexit": atexit._ncallbacks() - before_exit,
    "finders": [type(f).__name__ for f in sys.meta_path if f not in before_path],
}))
"""


def _run(code: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != backend.BLAS_ENV}
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_package_imports_no_mlx_loads_no_blas_and_registers_no_atexit() -> None:
    got = _run(IMPORT_PROBE)
    assert got["modules"] == []
    assert got["openblas"] is False
    assert got["atexit"] == 0
    # The one finder: it registers the LiteLLM provider right after `import litellm` (LiteLLM
    # has no entry point for providers, and importing it eagerly takes seconds), and loads the
    # BLAS right before `import mlx`.
    assert got["finders"] == ["_ImportHook"]


def test_the_engine_names_are_imported_on_first_access() -> None:
    got = _run("import json, sys, mlx_parallm_provider as p\nE = p.Engine\n"
               "print(json.dumps({'mlx': 'mlx.core' in sys.modules, 'same': E is __import__('mlx_parallm_provider.engine').engine.Engine}))")
    assert got == {"mlx": True, "same": True}


ENGINE_PROBE = """
import json, sys
if sys.argv[1] == "mlx-first":
    import mlx.core as mx
import mlx_parallm_provider as p
if sys.argv[1] == "package-then-mlx":
    import mlx.core as mx
from mlx_parallm_provider.models import backend
engine = p.Engine(sys.argv[2], p.EngineConfig(max_num_seqs=2, max_num_batched_tokens=64))
out = engine.generate_sync([1, 5, 9, 14], p.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
layer = type(engine._loaded.model.model.layers[0].self_attn.q_proj).__name__
print(json.dumps({"tokens": list(out.token_ids), "blas": backend.blas_in_use(), "layer": layer}))
engine.shutdown()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or backend.find_openblas() is None, reason="needs a system OpenBLAS")
def test_an_engine_gets_openblas_whichever_of_mlx_and_the_package_is_imported_first(tiny_model_dir) -> None:
    """The package imported first, OpenBLAS is loaded just before mlx (by the engine, or by the
    program's own `import mlx`); mlx imported first, the engine's dense layers go through
    OpenBLAS bound privately. The same tokens."""
    from mlx_parallm_provider.models import qmatmul_ext

    usual = _run(ENGINE_PROBE, "package-first", str(tiny_model_dir))
    assert usual["blas"].startswith("OpenBLAS") and usual["layer"] == "Linear"
    then_mlx = _run(ENGINE_PROBE, "package-then-mlx", str(tiny_model_dir))  # the hook loads it before mlx
    assert then_mlx["blas"].startswith("OpenBLAS") and then_mlx["tokens"] == usual["tokens"]
    if qmatmul_ext.load() is None:
        pytest.skip("the MLX extension does not build here: mlx imported first is a BackendError (test_backend.py)")
    first = _run(ENGINE_PROBE, "mlx-first", str(tiny_model_dir))
    assert first["blas"].startswith("reference") and first["layer"] == "PrivateBlasLinear"
    assert first["tokens"] == usual["tokens"] and len(usual["tokens"]) == 6
