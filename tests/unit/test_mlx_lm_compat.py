"""The mlx-lm private state the engine touches (``mlx_parallm_provider.mlx_lm_compat``) is
still where that module expects it, in the mlx-lm range ``pyproject.toml`` supports."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import mlx_parallm_provider.models  # noqa: F401  (BLAS before mlx)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlx_parallm_provider import mlx_lm_compat

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _triple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:3])


def test_the_supported_range_is_pyprojects_and_holds_the_installed_mlx_lm() -> None:
    low, high = re.search(r'"mlx-lm>=([\d.]+),<([\d.]+)"', PYPROJECT.read_text()).groups()
    assert (_triple(low), _triple(high + ".0")[:3]) == mlx_lm_compat.SUPPORTED
    assert mlx_lm_compat.SUPPORTED[0] <= _triple(version("mlx-lm")) < mlx_lm_compat.SUPPORTED[1]


def test_tool_parser_inference_still_answers() -> None:
    class Tokenizer:
        chat_template = "{% for m in messages %}<minimax:tool_call>{{ m.content }}{% endfor %}"

        def get_vocab(self) -> dict[str, int]:
            return {}

    assert mlx_lm_compat.infer_tool_parser(Tokenizer()) == "minimax_m2"
    assert mlx_lm_compat.infer_tool_parser(object()) is None  # it raised: None, never the error


def _gemma2(kv_heads: int) -> object:
    from mlx_lm.models import gemma2

    args = gemma2.ModelArgs(model_type="gemma2", hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
                            head_dim=8, rms_norm_eps=1e-6, vocab_size=64, num_key_value_heads=kv_heads)
    model = gemma2.Model(args)
    mx.eval(model.parameters())
    return model


def _left_padded_batch(model: object, rows: list[list[int]]) -> mx.array:
    width = max(map(len, rows))
    cache = [BatchKVCache(left_padding=[width - len(r) for r in rows]) for _ in model.layers]
    return model(mx.array([[0] * (width - len(r)) + r for r in rows]), cache=cache)


def _matches_rows_alone(model: object, rows: list[list[int]]) -> bool:
    try:
        batched = _left_padded_batch(model, rows)
    except ValueError:  # broadcast_shapes: (B, 1, L, S) against (B, kv_heads, repeats, L, S)
        return False
    return all(mx.allclose(batched[b, -len(row):], model(mx.array([row]))[0], atol=1e-4).item() for b, row in enumerate(rows))


def test_grouped_query_masks_are_fitted_per_instance_and_batches_match_rows_alone() -> None:
    model, other, ungrouped = _gemma2(kv_heads=2), _gemma2(kv_heads=2), _gemma2(kv_heads=4)
    two, three = [[5, 6, 7, 8, 9], [10, 11, 12]], [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    # the mlx-lm bug worked around: three rows fail, two (as many as the KV heads) broadcast
    # each row's mask onto one KV head instead, silently wrong; when mlx-lm fixes it, the fit can go
    assert not _matches_rows_alone(model, three) and not _matches_rows_alone(model, two)
    assert mlx_lm_compat.fit_grouped_query_masks(model) == 2
    assert mlx_lm_compat.fit_grouped_query_masks(ungrouped) == 0  # its scores are (B, heads, L, S): the mask fits
    assert type(other.model.layers[0].self_attn).__module__ == "mlx_lm.models.gemma2"
    assert _matches_rows_alone(model, three) and _matches_rows_alone(model, two)
    assert _matches_rows_alone(ungrouped, three)


def test_a_gemma2_routed_through_its_backend_needs_no_fitted_masks() -> None:
    """Routed, gemma2's attention is the backend's (which takes (B, 1, L, S) masks as they
    come): nothing is fitted, and a batch matches its rows alone."""
    from mlx_parallm_provider.models.backends import MLXOps, install

    model = _gemma2(kv_heads=2)
    assert install(model, MLXOps())
    routed = type(model.model.layers[0].self_attn)
    assert mlx_lm_compat.fit_grouped_query_masks(model) == 0 and type(model.model.layers[0].self_attn) is routed
    assert _matches_rows_alone(model, [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]])
