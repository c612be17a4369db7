"""Cached prefixes shared by decoding rows on the tiny model: the same tokens as with prefix
caching off while rows share, join mid-decode and leave, with the shared blocks attended once
(cascade attention, MLX's ops backend: the CPU kernels' paged decode reads every row's table
itself); a quantized model; and a model that computes attention itself over gathered blocks."""

from __future__ import annotations

import asyncio
import random
from typing import Any, Optional

import pytest

from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.engine.kv import paged_cache
from mlx_parallm_provider.models import backends

VOCAB = 49152


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.fixture
def group_sizes(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Records, for every cascade attention call, how many rows each shared prefix had."""
    seen: list[list[int]] = []
    real = paged_cache.cascade_attention

    def spy(queries, keys, values, scale, mask, groups, **kwargs):
        seen.append([rows.shape[0] for _, rows in groups])
        return real(queries, keys, values, scale, mask, groups, **kwargs)

    monkeypatch.setattr(paged_cache, "cascade_attention", spy)
    return seen


def _workload(seed: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """A first burst (two prefix groups, unshared rows, n > 1 copies), a second burst that
    arrives mid-decode (the same two prefixes, a new one) and everyone's max_tokens."""
    rng = random.Random(seed)
    a, b, c = ([1] + ids(rng, n) for n in (120, 70, 90))
    first = [a + ids(rng, 2 + i % 5) for i in range(6)] + [b + ids(rng, 4 + i) for i in range(4)]
    first += [[1] + ids(rng, 20 + 9 * i) for i in range(3)] + [b + ids(rng, 3)] * 3
    second = [a + ids(rng, 6) for _ in range(4)] + [c + ids(rng, 2 + i) for i in range(4)] + [b + ids(rng, 5)]
    lengths = [4 + (7 * i) % 17 for i in range(len(first) + len(second))]
    return first, second, lengths


def _run(engine, first, second, lengths) -> list[list[int]]:
    async def go():
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
        early = [asyncio.ensure_future(engine.generate(p, params[i])) for i, p in enumerate(first)]
        while engine.stats()["generated_tokens"] < 3 * len(first):  # the first burst is decoding
            await asyncio.sleep(0.005)
        late = [engine.generate(p, params[len(first) + i]) for i, p in enumerate(second)]
        return await asyncio.gather(*early, *late)

    return [c.token_ids for c in asyncio.run(go())]


def test_rows_sharing_joining_and_leaving_decode_the_same_tokens(tiny_model, make_engine, group_sizes) -> None:
    first, second, lengths = _workload(0)
    with backends.using(tiny_model.model, "mlx"):
        off = _run(make_engine(enable_prefix_caching=False), first, second, lengths)
        assert not group_sizes
        on = _run(make_engine(), first, second, lengths)
    assert on == off
    # Prefixes really were attended once for several rows, and more than one group at a time.
    assert max(max(g) for g in group_sizes) >= 4
    assert any(len(g) >= 2 for g in group_sizes)
    assert _run(make_engine(), first, second, lengths) == off  # the CPU kernels' backend


def test_quantized_model_same_tokens_with_sharing_on_and_off(tmp_path, tiny_model_dir, group_sizes) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from mlx_parallm_provider.models import registry
    from mlx_parallm_provider.models.registry import LoadedModel

    model, _ = load_model(tiny_model_dir)  # a fresh copy: the session's tiny model stays f32
    nn.quantize(model, group_size=32, bits=8)
    folder = tmp_path / "q8"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_model_dir / name).read_bytes())
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = (tiny_model_dir / "config.json").read_text()[:-1] + ', "quantization": {"group_size": 32, "bits": 8}}'
    (folder / "config.json").write_text(config)
    quantized = registry.load(str(folder), dequantize=False)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in quantized.model.named_modules())

    from mlx_parallm_provider.engine import Engine

    first, second, lengths = _workload(1)
    outs = []
    loaded = LoadedModel("q8", folder, quantized.model, quantized.tokenizer, quantized.config)
    with backends.using(quantized.model, "mlx"):  # (the cascade: see the module docstring)
        for on in (False, True):
            engine = Engine("q8", EngineConfig(enable_prefix_caching=on), loaded=loaded)
            try:
                outs.append(_run(engine, first, second, lengths))
            finally:
                engine.shutdown()
    assert outs[0] == outs[1] and max(max(g) for g in group_sizes) >= 4


class _SelfAttending:
    """Makes a llama attention layer compute attention itself (MLX's fused attention over what
    its cache returns, under the mask the model got from ``make_mask``), as a model file that
    never calls mlx-lm's ``scaled_dot_product_attention`` does: the backend cannot route it."""

    def __call__(self, x: Any, mask: Optional[Any] = None, cache: Optional[Any] = None) -> Any:
        import mlx.core as mx

        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def test_a_model_attending_itself_runs_on_gathered_blocks_with_the_same_tokens(tiny_model_dir, make_engine) -> None:
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_model_dir)  # a fresh copy, its layers changed below
    for layer in model.layers:
        attention = layer.self_attn
        attention.__class__ = type("SelfAttending", (_SelfAttending, type(attention)), {})
    first, second, lengths = _workload(2)
    engine = make_engine(model=model)
    assert not backends.routes_attention(model) and engine._core is None
    got = _run(engine, first, second, lengths)
    assert engine._core.runner.gathered  # noqa: SLF001
    assert got == _run(make_engine(), first, second, lengths)
