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
from mlx_parallm_provider.engine.kv.states import CHECKPOINT_TOKENS, RecurrentStates, StateCheckpoints, StateHit, StateSlots
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
    assert fitted.enable_prefix_caching and not (fitted.async_scheduling or fitted.grammar_fast_forward)
    assert fitted.max_num_seqs == config.max_num_seqs and config.enable_prefix_caching  # the caller's config untouched
    with pytest.raises(InvalidParameterError, match="speculative"):
        settings_for(hybrid, EngineConfig(speculative="ngram"))


def test_checkpoints_fall_every_interval_and_at_the_last_block_boundary() -> None:
    states = RecurrentStates({0: 1}, checkpoints=StateCheckpoints(1 << 20), block_size=16)
    every = CHECKPOINT_TOKENS
    assert states.checkpoint_ends(2 * every + 40) == [every, 2 * every, 2 * every + 32]
    assert states.checkpoint_ends(2 * every + 1) == [every, 2 * every]  # the last token is always computed
    assert states.checkpoint_ends(16) == [] and states.checkpoint_ends(17) == [16]
    assert RecurrentStates({0: 1}).checkpoint_ends(1000) == []  # no prefix caching: none


def test_checkpoints_are_dropped_least_recently_used_beyond_their_bytes() -> None:
    kept = StateCheckpoints(3 * 4 * 8)  # three states of 8 float32s
    for name in "abc":
        kept.put(name, {(0, 0): mx.zeros((1, 8))})
    kept.get("a")
    kept.put("d", {(0, 0): mx.zeros((1, 8))})
    assert "b" not in kept and all(n in kept for n in "acd") and kept.evictions == 1 and kept.nbytes == 96


def test_a_state_is_kept_and_loaded_into_another_slot() -> None:
    kept = StateCheckpoints(1 << 20)
    states = RecurrentStates({1: 2}, checkpoints=kept, names=lambda tokens, n, namespace: (tuple(tokens[: n * 4]), namespace),
                             block_size=4)
    step = states.open([0, 1], [0, 0], [8, 8], 8)
    step.caches[1][0] = mx.array([[1.0], [2.0]])
    step.caches[1][1] = mx.array([[3.0], [4.0]])
    step.commit()
    states.save(1, list(range(10)), 8, "ns")
    assert (tuple(range(8)), "ns") in kept
    states.load(5, (tuple(range(8)), "ns"))
    following = states.open([5], [8], [1], 1)
    assert following.caches[1][0].tolist() == [[2.0]] and following.caches[1][1].tolist() == [[4.0]]


def test_a_prefix_hit_reaches_only_as_far_as_a_kept_state() -> None:
    kept = StateCheckpoints(1 << 20)
    kv = StateSlots(64, 4, checkpoints=kept)
    tokens = list(range(100, 120))
    kv.grow("a", 21)
    kv.register("a", tokens, 20)
    keys = kv.block_keys(tokens, 5)
    assert kv.match(tokens, 19, 0).tokens == 0  # cached blocks, but no state kept at any of their ends
    kept.put(keys[1], {})
    kept.put(keys[3], {})
    hit = kv.match(tokens, 19, 0)
    assert isinstance(hit, StateHit) and hit.tokens == 16 and hit.state == keys[3] and hit.copy_from is None
    assert kv.match(tokens[:10] + [1] * 10, 19, 0).tokens == 8  # diverging in block 2: the state after block 1
    kv.grow("b", 20, hit)
    step = kv.for_step(["a", "b"])
    assert step.state_loads == {"b": keys[3]} and step.state_slots["b"] != step.state_slots["a"]
    assert kv.for_step(["b"]).state_loads == {}  # loaded once
    assert StateSlots(64, 4).match(tokens, 19, 0).tokens == 0  # no prefix caching: no hits


def test_a_prompt_waits_for_a_sharer_only_for_what_its_kept_states_make_reusable() -> None:
    from types import SimpleNamespace

    from mlx_parallm_provider.engine.kv.prefix_match import waits_for_sharer

    kv = StateSlots(64, 16, checkpoints=StateCheckpoints(1 << 20))
    assert kv.reusable(600, 620) == CHECKPOINT_TOKENS and kv.reusable(300, 620) == 0 and kv.reusable(612, 620) == 608

    def request(ids: list[int]) -> Any:
        return SimpleNamespace(prompt_ids=ids, computed_ids=ids, prompt_len=len(ids), num_cached=0, cache_namespace=0)

    sharer = request(list(range(620)))
    short = request(list(range(300)) + [9999] * 20)  # shares 300 tokens: no state kept inside them
    long = request(list(range(600)) + [9999] * 20)
    assert waits_for_sharer(short, 0, [sharer], 64) and not waits_for_sharer(short, 0, [sharer], 64, reusable=kv.reusable)
    assert waits_for_sharer(long, 0, [sharer], 64, reusable=kv.reusable)
