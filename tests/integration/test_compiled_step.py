"""A decode step's forward compiled (``mx.compile``): the same tokens and KV as uncompiled,
traces kept few by padding, and a pass that cannot be traced turns it off, not the engine.

On the CPU the GPU backend's kernels are stood for by MLX's ops on their inputs
(:func:`gpu_kernel_emulator.mlx_ops_launch`): nothing in a traced step may evaluate, as MLX's
custom kernels do not on a GPU. On a GPU (``-m gpu``) the real kernels run."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

from engine_helpers import peak_memory_above_now
from gpu_kernel_emulator import traceable_gpu_backend
from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.engine.compiled_step import CompiledDecode, padded_rows, padded_width
from mlx_parallm_provider.models import backends
from mlx_parallm_provider.models.backends.gpu_kernels import GPUKernels

pytestmark = pytest.mark.gpu

PROMPTS = [[1, 5 + i, 9, 30 + 3 * i, 7, 11, 200 + i, 40, 41, 42, 43][: 3 + 2 * i] for i in range(6)]
PARAMS = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(6)]  # rows leave one by one


_gpu = traceable_gpu_backend


def _run(tiny_model, make_engine, backend: GPUKernels, **config) -> tuple[list[list[int]], object]:
    with backends.using(tiny_model.model, backend):
        engine = make_engine(kv_block_size=4, **config)
        tokens = [o.token_ids for o in engine.generate_many_sync(PROMPTS, PARAMS)]
        return tokens, engine._core.runner


def test_padding_keeps_the_shapes_few() -> None:
    assert [padded_rows(n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 24, 64, 72]
    assert [padded_width(n) for n in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, 32]


@pytest.mark.parametrize("ahead", [True, False], ids=["decoding-ahead", "step-by-step"])
def test_compiled_decode_steps_give_the_tokens_of_uncompiled_ones(tiny_model, make_engine, monkeypatch, ahead: bool) -> None:
    """Greedy, 6 rows of mixed lengths leaving one by one (padded to 8, then 4...): the same
    tokens as the same backend uncompiled; every decode step after the first compiled, traced
    once per shape."""
    traces = []
    forward = CompiledDecode._forward
    monkeypatch.setattr(CompiledDecode, "_forward", lambda self, storage, *a: traces.append(a[0].shape) or forward(self, storage, *a))
    plain, runner = _run(tiny_model, make_engine, _gpu(compile_decode=False), async_scheduling=ahead)
    assert runner._compiled is None and runner.decode_path() == "uncompiled (compile_decode is off)" and not traces
    compiled, runner = _run(tiny_model, make_engine, _gpu(), async_scheduling=ahead)
    assert compiled == plain
    assert runner.decode_path() == "compiled" and runner._compiled.calls >= max(p.max_tokens for p in PARAMS) - 2
    assert 0 < len(traces) <= len(set(traces)) * 3  # (a shape traced again only when the KV arrays grew)
    assert {shape[0] for shape in traces} <= {8, 4, 2, 1}


def test_compiled_steps_write_the_kv_arrays_without_copying_them(tiny_model, make_engine) -> None:
    """A preallocated pool of ~16 MiB a KV array: the first steps of new shapes (1, 2, then 4
    padded rows), their checks and prefills, hold no copy of any KV array at any time (MLX
    copies an array whole to write a few slots where the graph holds it as it was)."""
    budget = 32768 * 4 * 2 * 2 * 2 * 16 * 4 / 1024**3  # 32,768 blocks of 4 tokens of the tiny llama's KV
    with backends.using(tiny_model.model, _gpu()):
        engine = make_engine(kv_block_size=4, kv_cache_memory_gb=budget)
        engine.generate_many_sync(PROMPTS[:1], PARAMS[0])  # (the pools made)
        storage = engine._core.runner.storage
        assert min(a.nbytes for a in storage.arrays()) >= 16 * 1024**2
        outputs = []
        assert peak_memory_above_now(lambda: outputs.extend(engine.generate_many_sync(PROMPTS[:3], PARAMS[:3]))) < 4 * 1024**2
        tokens = [o.token_ids for o in outputs]
        assert engine.stats()["decode"] == "compiled" and all(len(t) == p.max_tokens for t, p in zip(tokens, PARAMS))


def test_compiled_steps_answer_as_uncompiled_through_preemption_prefix_sharing_and_drafts(tiny_model, make_engine) -> None:
    """A pool too small for the batch (rows preempted and recomputed), prompts sharing cached
    prefix blocks, n-gram drafts verified (verify steps uncompiled, decode steps compiled):
    the same greedy tokens compiled and uncompiled."""
    shared = [7, 8, 9, 10] * 3
    prompts = [shared + [100 + i, 50 + 2 * i][: 1 + i % 2] for i in range(8)] + [[1, 5, 9, 14, 2, 5, 9, 14, 2, 5]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    budget = 24 * 4 * 2 * 2 * 2 * 16 * 4 / 1024**3  # 24 blocks of 4 tokens of the tiny llama's KV

    def tokens(**device) -> tuple[list[list[int]], dict, object]:
        with backends.using(tiny_model.model, _gpu(**device)):
            engine = make_engine(kv_block_size=4, kv_cache_memory_gb=budget, enable_prefix_caching=True, speculative="ngram")
            out = [o.token_ids for o in engine.generate_many_sync(prompts, params)]
            return out, engine.stats(), engine._core.runner

    plain, _, _ = tokens(compile_decode=False)
    compiled, stats, runner = tokens()
    assert compiled == plain
    assert stats["kv_cache"]["num_preemptions"] > 0 and stats["prefix_cache"]["hit_rate"] > 0 and stats["decode"] == "compiled"
    assert runner._compiled.calls > 0


def test_rows_with_a_lora_adapter_step_uncompiled(tiny_model, make_engine, tiny_model_dir, tmp_path) -> None:
    """Rows with adapters (their per-row state is no input of a trace) step uncompiled; once
    they have left, the rows without one step compiled; every row's tokens as uncompiled."""
    from lora_helpers import write_random_adapter

    adapter = str(write_random_adapter(tmp_path / "all", tiny_model_dir, rank=8, scale=10.0, seed=1))
    params = [SamplingParams(max_tokens=4 if i % 2 else 14, temperature=0.0, ignore_eos=True, lora=adapter if i % 2 else None)
              for i in range(4)]

    def tokens(**device) -> tuple[list[list[int]], object]:
        with backends.using(tiny_model.model, _gpu(**device)):
            engine = make_engine(kv_block_size=4)
            return [o.token_ids for o in engine.generate_many_sync(PROMPTS[:4], params)], engine._core.runner

    plain, _ = tokens(compile_decode=False)
    compiled, runner = tokens()
    assert compiled == plain and 0 < runner._compiled.calls <= 14 - 4


def test_a_pass_that_cannot_be_traced_turns_compiling_off_and_steps_run_uncompiled(tiny_model, make_engine, caplog) -> None:
    """``compile_decode=True`` where the layers gather (the kernels set to ``gather``): the
    trace fails, the KV arrays are as they were, the step and every later one run uncompiled,
    with the same tokens."""
    plain, _ = _run(tiny_model, make_engine, _gpu(paged_attention="gather", compile_decode=False))
    with caplog.at_level(logging.WARNING, logger="mlx_parallm_provider.engine.compiled_step"):
        tried, runner = _run(tiny_model, make_engine, _gpu(paged_attention="gather", compile_decode=True))
    assert tried == plain
    assert "NotTraceable" in runner.compiled_off and runner._compiled.calls == 0
    assert "decode steps run uncompiled" in caplog.text


def test_a_check_that_fails_on_the_device_turns_compiling_off_before_the_kv_is_touched(tiny_model, make_engine, monkeypatch,
                                                                                        caplog) -> None:
    """The first compiled pass, traced and replayed on scratch arrays, failing when evaluated
    (a kernel failing on the device): every step runs uncompiled, with the same tokens."""
    from mlx_parallm_provider.engine import compiled_step

    plain, _ = _run(tiny_model, make_engine, _gpu(compile_decode=False))

    class FailingEval:
        def __getattr__(self, name: str):
            return getattr(mx, name)

        @staticmethod
        def eval(*arrays) -> None:
            raise RuntimeError("a kernel failed on the device")

    monkeypatch.setattr(compiled_step, "mx", FailingEval())
    with caplog.at_level(logging.WARNING, logger="mlx_parallm_provider.engine.compiled_step"):
        tried, runner = _run(tiny_model, make_engine, _gpu())
    assert tried == plain
    assert runner.compiled_off == "RuntimeError: a kernel failed on the device" and runner._compiled.calls == 0
