"""A backend is chosen once per loaded model and reaches that model alone: another model of
the same architecture in the process (a user's own, the benchmark's mlx-lm peer) runs
mlx-lm's own code, and mlx-lm's modules are never changed."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)

# isort: split
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlx_parallm_provider.models import attention, backend, backends, cpu_ops, registry
from mlx_parallm_provider.models.backends import CPUKernels, MLXOps


def _globals(module_name: str) -> dict[str, object]:
    return dict(vars(sys.modules[module_name]))


def _kernel_counter(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call into this package's kernels and CPU formulations, by name."""
    calls: list[str] = []
    for owner, names in ((attention, ("decode_attention", "paged_decode_attention")), (cpu_ops, ("attention", "swiglu", "fast_exp"))):
        for name in names:
            real = getattr(owner, name)
            monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    fused = backends.cpu_kernels._fused()
    if fused is not None:  # the extension's SwiGLU, which CPUKernels prefers to cpu_ops'
        counting = SimpleNamespace(**{n: getattr(fused, n) for n in ("rms_norm", "rope")},
                                   swiglu=lambda *a: calls.append("swiglu") or fused.swiglu(*a))
        monkeypatch.setattr(backends.cpu_kernels, "_fused", lambda: counting)
    return calls


def _greedy(model, prompt: list[int], steps: int) -> tuple[mx.array, list[int]]:
    cache = [KVCache() for _ in model.layers]
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    first, tokens = logits, []
    for _ in range(steps):
        token = int(mx.argmax(logits, axis=-1).item())
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
    return first, tokens


def test_two_models_of_one_architecture_one_prepared_the_other_mlx_lm_alone(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx_lm

    module_name = "mlx_lm.models.llama"
    importlib.import_module(module_name)
    before = {name: _globals(name) for name in (module_name, "mlx_lm.models.base", "mlx_lm.models.activations")}
    served = registry._load_uncached(str(tiny_model_dir), None)  # engine=True: gets a backend
    peer = registry._load_uncached(str(tiny_model_dir), None, engine=False)  # the bench's mlx-lm peer
    fresh, _ = mlx_lm.load(str(tiny_model_dir))
    backend.prepare_model(fresh, engine=False)  # same weights in float32, nothing else
    after = {name: _globals(name) for name in before}
    assert all(after[n][k] is v for n in before for k, v in before[n].items()) and after.keys() == before.keys()

    assert backends.of(served.model) is not None and backends.routes_attention(served.model)
    assert backends.of(peer.model) is None and not backends.routes_attention(peer.model)
    assert all(type(m).__module__ != module_name or not hasattr(type(m), "_parallm_backend") for _, m in peer.model.named_modules())
    assert type(peer.model.layers[0].self_attn) is sys.modules[module_name].Attention
    assert isinstance(served.model.layers[0].self_attn, sys.modules[module_name].Attention)

    calls = _kernel_counter(monkeypatch)
    monkeypatch.setattr(cpu_ops, "MIN_ELEMENTS", 0)  # every formulation would run for a served model
    prompt = [5, 6, 7, 8, 9, 10, 11]
    peer_logits, peer_tokens = _greedy(peer.model, prompt, 4)
    fresh_logits, fresh_tokens = _greedy(fresh, prompt, 4)
    assert calls == []  # the peer ran none of our code
    assert mx.array_equal(peer_logits, fresh_logits).item() and peer_tokens == fresh_tokens

    served_logits, served_tokens = _greedy(served.model, prompt, 4)
    call = type(served.model.layers[0].self_attn).__call__
    routed = getattr(call, "__wrapped__", call).__globals__["scaled_dot_product_attention"]  # (behind the fused step)
    assert routed.__self__ is backends.of(served.model)  # its attention calls its backend
    if isinstance(backends.of(served.model), CPUKernels):
        assert {"attention", "swiglu", "decode_attention"} <= set(calls)
    assert mx.allclose(served_logits, fresh_logits, atol=1e-4).item() and served_tokens == fresh_tokens


def test_backend_is_chosen_once_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(backends.CPU_OPS_ENV, "0")
    assert type(backends.choose()) is MLXOps
    monkeypatch.setenv(backends.CPU_OPS_ENV, "on")
    monkeypatch.setenv(attention.THREADS_ENV, "3")
    chosen = backends.choose()
    monkeypatch.setenv(attention.THREADS_ENV, "5")  # read once: a later change is not seen
    assert isinstance(chosen, CPUKernels) and chosen.attention_threads == 3 and chosen.kernels
    monkeypatch.delenv(backends.CPU_OPS_ENV)
    assert isinstance(backends.choose(), CPUKernels) == (mx.default_device().type == mx.DeviceType.cpu)
    assert type(backends.choose("mlx")) is MLXOps and type(backends.choose(True)) is CPUKernels
    with pytest.raises(ValueError, match="unknown backend"):
        backends.choose("tpu")


def test_switching_and_removing_a_backend_on_one_model(tiny_model) -> None:
    model = tiny_model.model
    own = backends.of(model)
    attn_class = type(model.layers[0].self_attn)
    with backends.using(model, "mlx") as ops:
        assert backends.of(model) is ops and type(ops) is MLXOps and backends.routes_attention(model)
        assert type(model.layers[0].self_attn) is not attn_class  # rebound over the other backend
    assert backends.of(model) is own and type(model.layers[0].self_attn) is attn_class
    module = sys.modules[type(model).__module__]
    with backends.using(model, "cpu"):
        pass
    assert module.scaled_dot_product_attention is attention.mlx_lm_attention


def test_only_a_backend_with_a_layer_op_wraps_the_decoder_layers(tiny_model) -> None:
    block = tiny_model.model.layers[0]
    with backends.using(tiny_model.model, "mlx"):
        assert backends.routing.routed_backend(block) is None  # its class is mlx-lm's own: nothing to call through
    with backends.using(tiny_model.model, "cpu") as cpu:
        assert cpu.steps_layers and backends.routing.routed_backend(block) is cpu
        assert type(block).__call__.__wrapped__ is type(block).__mro__[1].__call__


@pytest.mark.parametrize("choice", ["cpu", "mlx"])
def test_greedy_batched_equals_one_at_a_time_on_each_backend(tiny_model, make_engine, choice: str) -> None:
    from mlx_parallm_provider.engine import SamplingParams

    prompts = [[1, 5 + i, 9, 30 + 3 * i, 7][: 3 + i % 3] for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with backends.using(tiny_model.model, choice) as chosen:
        engine = make_engine()
        together = engine.generate_many_sync(prompts, params)
        alone = [engine.generate_many_sync([p], params)[0] for p in prompts]
        assert backends.of(tiny_model.model) is chosen
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
