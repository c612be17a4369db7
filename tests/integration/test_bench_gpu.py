"""The GPU benchmark's sections and the random models it builds, run small on this machine."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from gpu_kernel_emulator import KernelLoop, mlx_ops_launch
from mlx_parallm_provider.bench import gpu, random_model
from mlx_parallm_provider.bench.gpu.breakdown import mlx_lm_model


@pytest.fixture(scope="module")
def tiny_random(smollm_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_model.build(tmp_path_factory.mktemp("random-tiny"), smollm_tokenizer_dir, "tiny", bits=0, dtype="float32")


def test_random_model_has_the_shape_quantization_and_tokenizer_asked_for(smollm_tokenizer_dir: Path, tmp_path: Path) -> None:
    import mlx_lm

    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text("{")  # a build cut short before: replaced whole
    folder = random_model.build(tmp_path / "q", smollm_tokenizer_dir, "tiny", bits=4)
    assert [p.name for p in tmp_path.iterdir()] == ["q"]  # (built beside it, then renamed)
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4} and config["num_hidden_layers"] == 2
    model, tokenizer = mlx_lm.load(str(folder))
    assert model.layers[0].self_attn.q_proj.bits == 4 and model.layers[0].self_attn.q_proj.scales.dtype == mx.bfloat16
    assert config["vocab_size"] == tokenizer.vocab_size


@pytest.mark.skipif(not KernelLoop.available(), reason="no C++ compiler")
def test_paged_step_times_report_both_paths_and_their_agreement(tmp_path: Path) -> None:
    kernels = KernelLoop(tmp_path)
    rows = gpu.paged_step_times(kernels, contexts=(40,), rows=(1, 3), heads=4, kv_heads=2, head_dim=32, block_size=4,
                                dtype=mx.float32, repeats=1)
    assert [(r["context"], r["rows"]) for r in rows] == [(40, 1), (40, 3)]
    assert all(r["max_diff"] < 1e-4 and r["kernel_ms"] > 0 and r["gather_ms"] > 0 for r in rows)
    assert all(r["int8_max_diff"] < 1e-3 and r["int8_kernel_ms"] > 0 and r["int8_gather_ms"] > 0 for r in rows)  # int8 blocks too
    narrow = gpu.paged_step_times(kernels, contexts=(40,), rows=(1,), heads=4, kv_heads=2, head_dim=16, block_size=4,
                                  dtype=mx.float32, repeats=1)
    assert "int8_kernel_ms" not in narrow[0]  # a head of 16 channels is not quantized in groups of 32


def test_agreement_compares_the_batched_engine_with_mlx_lm_alone(tiny_random: Path) -> None:
    result = gpu.agreement(str(tiny_random), prompts=4, tokens=8)
    assert result["batch_size"] == 4 and len(result["agreeing_prefix"]) == 4
    assert result["rows_identical"] == sum(p == 8 for p in result["agreeing_prefix"])
    assert result["rows_identical"] == 4  # float32 on both sides


def test_step_breakdown_times_each_part_at_each_row_count(tiny_random: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_PARALLM_CPU_OPS", "0")  # MLX's ops, as on a GPU
    rows = gpu.step_breakdown(str(tiny_random), rows=(1, 4), tokens=6)
    assert [r["rows"] for r in rows] == [1, 4]
    for r in rows:
        assert r["step_ms"] > 0 and r["matmul_ms"] > 0 and r["attention_ms"] > 0 and r["sampling_ms"] > 0
        assert r["rest_ms"] == pytest.approx(r["step_ms"] - r["matmul_ms"] - r["attention_ms"] - r["sampling_ms"])
        assert 0 < r["graph_ms"] < 10 * r["step_ms"]  # the decode steps' forwards at this row count were timed
        assert isinstance(r["graph_nodes"], int) and r["graph_nodes"] > 0  # and one of them counted
        assert r["decode"] == "uncompiled (the backend has no GPU paged kernels)" and r["uncompiled_step_ms"] is None
        assert r["core_step_ms"] >= r["step_ms"] * 0.5 and r["mlx_lm_step_ms"] > 0  # the whole step; mlx-lm's at the same rows
        assert r["vs_mlx_lm"] == pytest.approx(r["mlx_lm_step_ms"] / r["core_step_ms"])
        assert r["chat_sampling_ms"] > 0 and r["unfolded_matmul_ms"] > 0 and r["unstacked_matmul_ms"] > 0
        assert r["unstacked_step_ms"] is None  # (a float model: nothing stacked)


@pytest.mark.parametrize("bits", [0, 4], ids=["float32", "4-bit"])
def test_the_breakdown_multiplies_as_the_engine_does_its_stacked_siblings_as_one_product(
        smollm_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bits: int) -> None:
    """A quantized model loaded for an engine on MLX's ops: each block's q/k/v and gate/up one
    product (each layer's own output, side by side), every other linear layer alone, none
    twice; a float model's layers all alone."""
    from mlx_parallm_provider.bench.gpu.siblings import engine_products, linear_layers
    from mlx_parallm_provider.models import registry

    monkeypatch.setenv("MLX_PARALLM_CPU_OPS", "0")  # MLX's ops, as on a GPU
    folder = random_model.build(tmp_path / "m", smollm_tokenizer_dir, "tiny", bits=bits, dtype="float32")
    model = registry.load(str(folder), dequantize=False).model
    products = engine_products(model)
    blocks = model.model.layers
    x = mx.random.normal((3, 1, model.args.hidden_size), key=mx.random.key(1))
    if not bits:
        assert [id(p.product) for p in products] == [id(layer) for layer in linear_layers(model)]
        return
    groups = [(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj) for b in blocks] + [(b.mlp.gate_proj, b.mlp.up_proj) for b in blocks]
    stacks, single = products[: len(groups)], products[len(groups) :]
    want = {tuple(map(id, g)): [layer(x) for layer in g] for g in groups}
    matched = set()
    for stack in stacks:  # (each stack gives one group's outputs, each layer's own, bit for bit)
        assert stack.width == model.args.hidden_size
        got = stack.product(x)
        matched |= {k for k, outs in want.items() if len(outs) == len(got) and all(mx.array_equal(a, b) for a, b in zip(got, outs))}
    assert matched == set(want)
    assert sorted(id(p.product) for p in single) == sorted(id(layer) for b in blocks for layer in (b.self_attn.o_proj, b.mlp.down_proj))


def test_mlx_lm_steps_are_timed_while_every_row_decodes(tiny_random: Path) -> None:
    model = mlx_lm_model(str(tiny_random))
    assert gpu.mlx_lm_step_ms(model, [[1, 2, 3], [4, 5, 6, 7, 8]], tokens=6) > 0
    assert gpu.mlx_lm_step_ms(model, [[1, 2, 3]], tokens=1) is None  # its only token comes with the prefill: no step


def test_step_breakdown_times_compiled_decode_steps_against_uncompiled_ones(tiny_random: Path) -> None:
    from mlx_parallm_provider.config import DeviceConfig
    from mlx_parallm_provider.models import backends, registry
    from mlx_parallm_provider.models.backends.gpu_kernels import GPUKernels

    backend = GPUKernels(DeviceConfig(), launch=mlx_ops_launch, platform="test")  # (the kernels by MLX's ops: traceable)
    with backends.using(registry.load(str(tiny_random)).model, backend):
        rows = gpu.step_breakdown(str(tiny_random), rows=(3,), tokens=6)
    assert rows[0]["decode"] == "compiled" and rows[0]["uncompiled_step_ms"] > 0 and rows[0]["graph_nodes"] > 0
    assert backend.device.compile_decode is None  # (turned off for the uncompiled run alone)


def test_step_breakdown_times_the_engines_steps_with_its_stacked_siblings_set_aside_and_reports_each_row_count(
        smollm_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_parallm_provider.models import registry
    from mlx_parallm_provider.models.backends.stacked import QKV, stacked

    monkeypatch.setenv("MLX_PARALLM_CPU_OPS", "0")  # MLX's ops, as on a GPU: a quantized model's siblings stacked
    monkeypatch.setenv("MLX_PARALLM_DEQUANTIZE", "0")  # (kept quantized, as on a GPU)
    folder = random_model.build(tmp_path / "m", smollm_tokenizer_dir, "tiny", bits=4, dtype="float32")
    attention = registry.load(str(folder)).model.layers[0].self_attn
    seen: list[list[int]] = []
    rows = gpu.step_breakdown(str(folder), rows=(1, 3), tokens=4, done=lambda so_far: seen.append([r["rows"] for r in so_far]))
    assert seen == [[1], [1, 3]]
    assert all(r["unstacked_step_ms"] > 0 for r in rows)
    assert stacked(attention, QKV) is not None  # (stacked again after)


def test_graph_nodes_counts_the_ops_not_yet_evaluated() -> None:
    held = mx.ones((2, 3))
    mx.eval(held)
    assert gpu.graph_nodes(mx.exp(held)) == 1
    assert gpu.graph_nodes(mx.exp(held) + held, held * 2) == 4  # exp, add; the scalar's broadcast, multiply


def test_a_breakdown_cut_short_keeps_its_rows_so_far(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from mlx_parallm_provider.bench.gpu import __main__ as command

    def failing(model, rows, launch=None, done=None):
        done([{"rows": rows[0], "step_ms": 1.5}])
        raise RuntimeError("out of time")

    monkeypatch.setattr(command, "step_breakdown", failing)
    out = tmp_path / "gpu.json"
    assert command.main(["--model", "unused", "--rows", "1,8", "--skip", "paged,agreement", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["breakdown"] == {"error": "RuntimeError: out of time", "rows": [{"rows": 1, "step_ms": 1.5}]}
    assert '- breakdown: {"rows": 1, "step_ms": 1.5}' in capsys.readouterr().out  # (printed as each row count ends)
