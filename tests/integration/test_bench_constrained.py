"""The constrained-decoding benchmark on the tiny model: its passes run and compare like
with like (never a speed)."""

from __future__ import annotations

from mlx_parallm_provider.bench import constrained
from mlx_parallm_provider.engine import sampling


def test_json_pass_is_compared_with_a_twin_that_decodes_the_same_tokens_per_row(make_engine) -> None:
    engine = make_engine()
    real = (sampling.grammar_bitmask, sampling.apply_bitmask)
    passes = constrained.measure(engine, [f"Trip {i}:" for i in range(4)], max_tokens=12, repeats=2)
    assert (sampling.grammar_bitmask, sampling.apply_bitmask) == real  # the timer is taken out again
    assert passes["JSON schema"].counts == passes["unconstrained twin"].counts
    assert all(c == [12] * 4 for c in passes["unconstrained"].counts + passes["any-text grammar"].counts)
    assert len(passes["JSON schema"].mask_ms) == 1 and passes["JSON schema"].mask_ms[0] > 0 and not passes["unconstrained"].mask_ms
    assert "(unconstrained twin)" in passes["JSON schema"].row(passes["unconstrained twin"])
