"""Hybrid models' recurrent states (:mod:`mlx_parallm_provider.engine.kv.states`): slots held
and given back with a request's blocks, rows gathered and written back per pass, fresh rows
starting from zeros; which models are served (:mod:`.kv.support`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlx_parallm_provider.config import EngineConfig
from mlx_parallm_provider.engine.kv.states import RecurrentStates, StateSlots
from mlx_parallm_provider.engine.kv.support import layer_windows, pads_states, recurrent_layers, settings_for, unsupported_reason
from mlx_parallm_provider.errors import InvalidParameterError


@dataclass
class FakeModel:
    """A model as the KV code sees it: its layers and the caches mlx-lm would make for them."""

    kinds: list[Any]

    @property
    def layers(self) -> list[int]:
        return list(range(len(self.kinds)))

    def make_cache(self) -> list[Any]:
        return [kind() for kind in self.kinds]


def _conv():
    return ArraysCache(1)


def _scan():
    return ArraysCache(2)


def test_slots_are_held_per_request_and_reused_after_free_or_preemption() -> None:
    kv = StateSlots(64, 4)
    for owner in ("a", "b", "c"):
        kv.grow(owner, 5)
    kv.grow("a", 9)  # growing again keeps its slot
    assert kv.for_step(["a", "b", "c"]).state_slots == {"a": 0, "b": 1, "c": 2}
    kv.free("b")
    kv.preempted("a")
    kv.grow("d", 3)
    kv.grow("e", 3)
    kv.grow("f", 3)
    slots = kv.for_step(["c", "d", "e", "f"]).state_slots
    assert slots["c"] == 2 and {slots["d"], slots["e"]} == {0, 1} and slots["f"] == 3
    assert kv.num_preemptions == 1 and kv.num_free == 63 - 5  # c holds 2 blocks, d, e and f one each: a and b gave theirs back


def test_a_pass_gathers_its_rows_writes_them_back_and_fresh_rows_start_from_zeros() -> None:
    states = RecurrentStates({0: 1, 2: 2})
    first = states.open([0, 1], [0, 0], [3, 3], 3)
    assert all(c[e] is None for c in first.caches.values() for e in range(len(c.cache)))  # every row fresh: the layer makes zeros
    assert all(c.lengths is None for c in first.caches.values())  # no padding
    first.caches[0][0] = mx.array([[1.0, 1.0], [2.0, 2.0]])
    first.caches[2][0] = mx.array([[[1.0]], [[2.0]]])
    first.caches[2][1] = mx.array([[10.0], [20.0]])
    first.commit()
    assert states.num_slots >= 2 and states.nbytes > 0

    # Slot 1 goes on at position 3; slot 0, given to a new request, starts again; slot 5 is new.
    second = states.open([1, 0, 5], [3, 0, 0], [1, 2, 2], 2)
    assert second.caches[0][0].tolist() == [[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]
    assert second.caches[2][1].tolist() == [[20.0], [0.0], [0.0]]
    assert second.caches[0].lengths.tolist() == [1, 2, 2]  # right padding: the layer keeps a state at its row's length
    second.caches[0][0] = mx.array([[3.0, 3.0], [4.0, 4.0], [5.0, 5.0]])
    second.commit()
    third = states.open([0, 1, 5], [2, 4, 2], [1, 1, 1], 1)
    assert third.caches[0][0].tolist() == [[4.0, 4.0], [3.0, 3.0], [5.0, 5.0]]
    assert third.caches[2][0].tolist() == [[[0.0]], [[2.0]], [[0.0]]]  # untouched by the second pass (None there: kept)


def test_layers_that_take_no_padding_refuse_a_padded_pass() -> None:
    states = RecurrentStates({0: 2}, padded=False)
    assert states.open([0, 1], [0, 0], [3, 3], 3).caches[0].lengths is None
    with pytest.raises(ValueError, match="a row at a time"):
        states.open([0, 1], [0, 0], [3, 2], 3)


def test_which_modules_take_padded_rows() -> None:
    def model_of(module: str) -> Any:
        return type("Model", (), {"__module__": f"mlx_lm.models.{module}"})()

    assert pads_states(model_of("lfm2")) and pads_states(model_of("qwen3_5")) and pads_states(model_of("granitemoehybrid"))
    assert not pads_states(model_of("jamba"))  # it keeps the last inputs of the pass, padding or not


def test_interleave_puts_each_layers_cache_in_its_place() -> None:
    states = RecurrentStates({0: 1, 2: 2})
    step = states.open([0], [0], [1], 1)
    caches = step.interleave(["attn1", "attn3"])
    assert caches[0] is step.caches[0] and caches[1] == "attn1" and caches[2] is step.caches[2] and caches[3] == "attn3"


def test_which_models_are_served() -> None:
    hybrid = FakeModel([_conv, KVCache, _scan, lambda: RotatingKVCache(max_size=8, keep=0)])
    assert unsupported_reason(hybrid) is None
    assert layer_windows(hybrid) == [None, 8]  # the attention layers only
    assert recurrent_layers(hybrid) == {0: 1, 2: 2}
    assert "no attention layer" in unsupported_reason(FakeModel([_scan, _scan]))
    assert "neither a KV cache nor a recurrent state" in unsupported_reason(FakeModel([KVCache, lambda: RotatingKVCache(8, keep=4)]))
    assert recurrent_layers(FakeModel([KVCache])) == {}


def test_a_hybrid_models_settings() -> None:
    hybrid, plain = FakeModel([_conv, KVCache]), FakeModel([KVCache])
    config = EngineConfig()
    assert settings_for(plain, config) is config
    fitted = settings_for(hybrid, config)
    assert not (fitted.enable_prefix_caching or fitted.async_scheduling or fitted.grammar_fast_forward)
    assert fitted.max_num_seqs == config.max_num_seqs and config.enable_prefix_caching  # the caller's config untouched
    with pytest.raises(InvalidParameterError, match="speculative"):
        settings_for(hybrid, EngineConfig(speculative="ngram"))
