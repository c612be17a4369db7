"""Per-request LoRA adapters: a batch mixing adapters (and none) answers as mlx-lm does with
each adapter alone; prefix blocks are never shared across adapters; bad adapters are a 400."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lora_helpers import mlx_lm_greedy_with_adapter, write_random_adapter
from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.errors import EngineOverloadedError, InvalidParameterError

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": write_random_adapter(root / "all", tiny_model_dir, rank=8, scale=10.0, seed=1),
        "qv": write_random_adapter(root / "qv", tiny_model_dir, rank=4, scale=20.0, num_layers=1,
                                   keys=["self_attn.q_proj", "self_attn.v_proj"], seed=2, b_std=0.2),
        "mlp": write_random_adapter(root / "mlp", tiny_model_dir, rank=16, scale=5.0, keys=["mlp.down_proj", "mlp.up_proj"], seed=3),
    }


def _prompts(engine) -> list[list[int]]:
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colours:",
             "The capital of France is", "1, 2, 3, 4,", "Translate to German: cat", "Hello! How are"]
    return [engine.encode(t) for t in texts]


def test_eight_rows_four_adapters_answer_as_mlx_lm_with_each_adapter_alone(make_engine, tiny_model_dir, adapters) -> None:
    # The window closes when all 8 have arrived: each submit loads its adapter, which on a busy
    # machine takes longer than the default 5 ms window.
    engine = make_engine(max_num_seqs=8, batch_window_ms=10_000)
    prompts = _prompts(engine)
    names = [None, "all", "qv", "mlp", None, "all", "qv", "mlp"]
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, lora=None if n is None else str(adapters[n])) for n in names]
    got = [c.token_ids for c in engine.generate_many_sync(prompts, params)]
    for row, (name, prompt) in enumerate(zip(names, prompts)):
        want = mlx_lm_greedy_with_adapter(tiny_model_dir, None if name is None else adapters[name], [prompt], MAX_TOKENS)[0]
        assert got[row] == want, f"row {row} (adapter {name})"
    base = mlx_lm_greedy_with_adapter(tiny_model_dir, None, prompts, MAX_TOKENS)
    assert all(got[r] != base[r] for r in (1, 3, 5, 7)), "the adapters change the answers (else this test proves nothing)"
    assert engine.stats()["max_batch_size"] == 8


def test_registered_names_stats_and_no_prefix_sharing_across_adapters(make_engine, tiny_model_dir, adapters) -> None:
    engine = make_engine()
    engine.add_lora("writer", adapters["all"])
    prompt = engine.encode("A long shared system prompt that fills several KV blocks of sixteen tokens, then a question: why?")
    base = engine.generate_sync(prompt, SamplingParams(max_tokens=4))
    first = engine.generate_sync(prompt, SamplingParams(max_tokens=4, lora="writer"))
    again = engine.generate_sync(prompt, SamplingParams(max_tokens=4, lora="writer"))
    other = engine.generate_sync(prompt, SamplingParams(max_tokens=4, lora=str(adapters["qv"])))
    assert first.usage.cached_tokens == 0  # the base model's blocks are not the adapter's
    assert again.usage.cached_tokens >= 16  # the adapter's own blocks are
    assert other.usage.cached_tokens == 0
    assert first.token_ids == again.token_ids == mlx_lm_greedy_with_adapter(tiny_model_dir, adapters["all"], [prompt], 4)[0]
    assert base.token_ids != first.token_ids
    lora = engine.stats()["lora"]
    assert lora["registered"] == {"writer": str(adapters["all"].resolve())}
    assert lora["finished_requests"] == {"writer": 2, str(adapters["qv"]): 1}
    assert lora["generation_tokens"]["writer"] == 8
    assert {4, 8} <= {r["rank"] for r in lora["resident"]}  # (the model's slots: earlier tests' adapters may be resident too)
    assert engine.remove_lora("writer") and not engine.remove_lora("writer")
    with pytest.raises(InvalidParameterError, match="unknown adapter 'writer'"):
        engine.generate_sync(prompt, SamplingParams(max_tokens=2, lora="writer"))


def _copy(adapter: Path, target: Path) -> Path:
    shutil.copytree(adapter, target)
    return target


def test_bad_adapters_are_invalid_parameter_errors_and_harm_no_other_row(make_engine, adapters, tmp_path, smollm_tokenizer_dir) -> None:
    from conftest import TINY_CONFIG, write_tiny_model

    engine = make_engine(max_num_seqs=8)
    no_weights = _copy(adapters["all"], tmp_path / "no-weights")
    (no_weights / "adapters.safetensors").unlink()
    bad_json = _copy(adapters["all"], tmp_path / "bad-json")
    (bad_json / "adapter_config.json").write_text("{not json")
    dora = _copy(adapters["all"], tmp_path / "dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "dora"}))
    wrong_rank = _copy(adapters["all"], tmp_path / "wrong-rank")
    config["lora_parameters"]["rank"] = 4
    (wrong_rank / "adapter_config.json").write_text(json.dumps(config))
    damaged = _copy(adapters["all"], tmp_path / "damaged")
    (damaged / "adapters.safetensors").write_bytes(b"\x00" * 64)
    other_base = write_tiny_model(tmp_path / "wider", smollm_tokenizer_dir, config={**TINY_CONFIG, "hidden_size": 96, "head_dim": 24})
    wider = write_random_adapter(tmp_path / "wider-adapter", other_base)
    cases = {
        str(tmp_path / "missing"): "no such adapter folder",
        str(no_weights): "missing adapters.safetensors",
        str(bad_json): "is not JSON",
        str(dora): "fine_tune_type 'dora' is not supported",
        str(wrong_rank): "do not fit the base layer",
        str(damaged): "could not be read",
        str(wider): "do not fit the base layer",
        "no-such-name": "unknown adapter",
    }
    prompt = engine.encode("Hello")
    good = SamplingParams(max_tokens=3, lora=str(adapters["all"]))
    for lora, message in cases.items():
        with pytest.raises(InvalidParameterError, match=message) as info:
            engine.generate_sync(prompt, SamplingParams(max_tokens=3, lora=lora))
        assert info.value.field == "lora"
    results = engine.generate_many_sync([prompt] * 3, [good, SamplingParams(max_tokens=3, lora=str(dora)), SamplingParams(max_tokens=3)],
                                        return_exceptions=True)
    assert isinstance(results[1], InvalidParameterError)
    assert results[0].token_ids == engine.generate_sync(prompt, good).token_ids and len(results[2].token_ids) == 3
    with pytest.raises(InvalidParameterError, match="lora"):
        SamplingParams(lora="")
    with pytest.raises(InvalidParameterError, match="lora_name"):
        engine.add_lora("", adapters["all"])
    with pytest.raises(InvalidParameterError, match="is not JSON"):
        engine.add_lora("broken", bad_json)


def test_slots_are_bounded_held_by_requests_and_reused_least_recently_used_first(tiny_model_dir, adapters) -> None:
    from mlx_lm.utils import load_model

    from mlx_parallm_provider.models.lora.slots import adapters_of

    model, _ = load_model(tiny_model_dir)  # (a model of its own: the engines' model keeps its slots)
    slots = adapters_of(model, max_loras=2)
    a, b = slots.acquire(adapters["all"]), slots.acquire(adapters["qv"])
    assert {a.slot, b.slot} == {1, 2}
    with pytest.raises(EngineOverloadedError, match="max_loras"):
        slots.acquire(adapters["mlp"])
    b.release()
    b.release()  # (idempotent)
    c = slots.acquire(adapters["mlp"])
    assert c.slot == b.slot and slots.evictions == 1
    assert [r["path"] for r in slots.resident()] == sorted([str(adapters["all"].resolve()), str(adapters["mlp"].resolve())],
                                                           key=lambda p: {a.path: a.slot, c.path: c.slot}[Path(p)])
    again = slots.acquire(adapters["all"])
    assert again.slot == a.slot and slots.loads == 3  # still resident: not read again
    for use in (a, c, again):
        use.release()


def test_litellm_and_langchain_doors_take_lora_and_answer_as_the_engine(tiny_model_dir, adapters) -> None:
    import litellm
    from langchain_core.messages import HumanMessage

    from mlx_parallm_provider import get_engine, register, shutdown_engines
    from mlx_parallm_provider.langchain import ChatMLXParallm

    shutdown_engines()
    register()
    try:
        model = str(tiny_model_dir)
        engine = get_engine(model)
        engine.add_lora("qv", adapters["qv"])
        messages = [{"role": "user", "content": "Name a colour."}]
        plain = litellm.completion(model=f"mlx-parallm/{model}", messages=messages, max_tokens=6, ignore_eos=True)
        by_name = litellm.completion(model=f"mlx-parallm/{model}", messages=messages, max_tokens=6, ignore_eos=True, lora="qv")
        by_path = litellm.completion(model=f"mlx-parallm/{model}", messages=messages, max_tokens=6, ignore_eos=True,
                                     extra_body={"lora": str(adapters["qv"])})
        assert by_name.choices[0].message.content == by_path.choices[0].message.content != plain.choices[0].message.content
        with pytest.raises(litellm.BadRequestError, match="unknown adapter"):
            litellm.completion(model=f"mlx-parallm/{model}", messages=messages, max_tokens=2, lora="nope")
        chat = ChatMLXParallm(model=model, max_tokens=6, ignore_eos=True, lora="qv")
        assert chat.invoke([HumanMessage("Name a colour.")]).content == by_name.choices[0].message.content
        assert ChatMLXParallm(model=model, max_tokens=6, ignore_eos=True).bind(lora="qv").invoke("Name a colour.").content == by_name.choices[0].message.content
        with pytest.raises(ValueError, match="lora"):
            ChatMLXParallm(model=model, lora="")
    finally:
        shutdown_engines()


def test_the_cpu_one_op_update_equals_the_gathered_one_and_leaves_rows_without_an_adapter_as_they_are() -> None:
    import mlx.core as mx

    from mlx_parallm_provider.models.lora import layers

    op = layers._update_op()
    if op is None:
        pytest.skip("the CPU extension is not built here (the gathered update runs)")
    mx.random.seed(0)
    rows, length, k, n, r = 5, 3, 40, 24, 6
    a = mx.random.normal((3, k, r)) * (mx.arange(3) > 0).astype(mx.float32)[:, None, None]  # slot 0: zeros, as stacked
    b = mx.random.normal((3, r, n)) * (mx.arange(3) > 0).astype(mx.float32)[:, None, None]
    x = mx.random.normal((rows, length, k))
    shared = mx.random.normal((rows, length, 2 * n))
    y = shared[..., n:]  # a column slice, as a q/k/v layer's output is
    slots, scales = mx.array([0, 1, 2, 1, 0], dtype=mx.uint32), mx.array([0.0, 2.0, 0.5, 2.0, 0.0])
    got = op(y, x, mx.contiguous(a.swapaxes(1, 2)), b, slots, scales, 2)
    want = y + scales[:, None, None] * mx.gather_mm(mx.gather_mm(x, a, rhs_indices=slots), b, rhs_indices=slots)
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(got[0], y[0]).item() and mx.array_equal(got[4], y[4]).item()


def test_the_gathered_update_answers_as_mlx_lm_too(make_engine, tiny_model_dir, adapters, monkeypatch) -> None:
    from mlx_parallm_provider.models.lora import layers

    monkeypatch.setattr(layers, "_op", [None])  # (as off the CPU, or without the extension)
    engine = make_engine(max_num_seqs=4)
    prompts = _prompts(engine)[:4]
    names = [None, "all", "qv", "mlp"]
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, lora=None if n is None else str(adapters[n])) for n in names]
    got = [c.token_ids for c in engine.generate_many_sync(prompts, params)]
    for row, (name, prompt) in enumerate(zip(names, prompts)):
        assert got[row] == mlx_lm_greedy_with_adapter(tiny_model_dir, None if name is None else adapters[name], [prompt], MAX_TOKENS)[0], row
