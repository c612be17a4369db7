"""Prefix caching with a rotating KV cache (``max_kv_size``) on the rectangle layout's store,
on the tiny random llama: the first ``max_kv_size - 1`` tokens of a prompt are reused, copied
per row, with the same tokens as with caching off, and nothing is stored from a row whose
first tokens left the window. (On paged KV a window is a window of blocks:
test_paged_engine.py.)"""

from __future__ import annotations

import asyncio
import random

import pytest

from test_prefix_caching import ids, mixed_workload

from mlx_parallm_provider.engine import SamplingParams


def _run_all(engine, prompts, params_for) -> list:
    async def go():
        return await asyncio.gather(*(engine.generate(p, params_for(i)) for i, p in enumerate(prompts)))

    return asyncio.run(go())


@pytest.mark.parametrize("window", [128, 256])
def test_greedy_and_seeded_outputs_match_with_caching_on_and_off_under_a_window(make_engine, window) -> None:
    # Prefixes of 81, 151 and 301 tokens, chunked unshared prompts of 201-281, n > 1: only
    # the first window - 1 tokens of a prompt can be reused; greedy rows decode past the
    # window. (Seeded rows draw from the top 20 tokens: over all 49k tokens of the random
    # model's flat distributions, float noise of a different batch layout, ~1e-5 in a
    # logprob, can flip a sample, with a plain KV cache too.)
    prompts = mixed_workload(seed=11)
    greedy = lambda i: SamplingParams(max_tokens=40, ignore_eos=True)  # noqa: E731
    seeded = lambda i: SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.9, top_k=20, seed=i)  # noqa: E731
    for params_for in (greedy, seeded):
        off = _run_all(make_engine(kv_layout="rectangle", max_kv_size=window, prefill_chunk_size=128, enable_prefix_caching=False), prompts, params_for)
        engine = make_engine(kv_layout="rectangle", max_kv_size=window, prefill_chunk_size=128)
        on = _run_all(engine, prompts, params_for)
        assert [c.token_ids for c in on] == [c.token_ids for c in off]
        cached = [c.usage.cached_tokens for c in on]
        assert max(cached) <= window - 1
        assert sum(c >= 81 for c in cached) >= 7  # the 81-token group, but its first row
        stats = engine.stats()["prefix_cache"]
        assert stats["enabled"] and stats["cached_tokens"] == sum(cached)


def test_a_second_request_reuses_at_most_the_window_less_one(make_engine) -> None:
    rng = random.Random(12)
    short, long = [1] + ids(rng, 40), [2] + ids(rng, 150)
    params = SamplingParams(max_tokens=70, ignore_eos=True)  # decodes past the window
    off = make_engine(kv_layout="rectangle", max_kv_size=64, prefill_chunk_size=256, enable_prefix_caching=False)
    engine = make_engine(kv_layout="rectangle", max_kv_size=64, prefill_chunk_size=256)
    for prompt, reused in ((short, len(short)), (long, 63)):  # the long one: one-piece prefill
        first = engine.generate_sync(prompt + [5], params)
        second = engine.generate_sync(prompt + [6], params)
        assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == reused
        assert second.token_ids == off.generate_sync(prompt + [6], params).token_ids
    # Turn 2 reuses turn 1 while turn 1 stayed inside the window...
    turn1 = short + [7]
    answer = engine.generate_sync(turn1, SamplingParams(max_tokens=10, ignore_eos=True)).token_ids
    turn2 = turn1 + answer + ids(rng, 4)
    again = engine.generate_sync(turn2, params)
    assert again.usage.cached_tokens == len(turn1) + len(answer) - 1
    assert again.token_ids == off.generate_sync(turn2, params).token_ids
    # ...and only its prompt once its answer pushed the prompt's start out of the window.
    turn3 = short + [6] + second.token_ids + ids(rng, 4)
    assert engine.generate_sync(turn3, SamplingParams(max_tokens=2)).usage.cached_tokens == len(short) + 1


def test_nothing_is_stored_from_a_row_whose_first_tokens_left_the_window(make_engine) -> None:
    rng = random.Random(13)
    prompt = [1] + ids(rng, 100)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    # Prefilled in pieces of 32 into a window of 64, the row has lost its first tokens
    # by the time its prefill ends, and it stores nothing.
    chunked = make_engine(kv_layout="rectangle", max_kv_size=64, prefill_chunk_size=32)
    chunked.generate_sync(prompt, params)
    assert chunked.stats()["prefix_cache"]["cached_tokens_stored"] == 0
    second = chunked.generate_sync(prompt, params)
    assert second.usage.cached_tokens == 0
    # Prefilled in one piece, the cache still holds the prompt from its first token.
    whole = make_engine(kv_layout="rectangle", max_kv_size=64, prefill_chunk_size=256)
    whole.generate_sync(prompt, params)
    assert whole.stats()["prefix_cache"]["cached_tokens_stored"] == 63
    assert whole.generate_sync(prompt, params).token_ids == second.token_ids


def test_rows_leaving_a_right_padded_rotating_prefill_leave_the_others_unchanged(tiny_model) -> None:
    import mlx.core as mx

    from mlx_parallm_provider.engine.prefill import new_batch_cache, run_right_padded

    model, rng = tiny_model.model, random.Random(14)
    bodies = [ids(rng, 21), ids(rng, 7), ids(rng, 13)]
    layers = len(model.layers)

    def decode_logits(rows: list[list[int]], drop_after_first_piece: bool) -> mx.array:
        cache = new_batch_cache(layers, [0] * len(rows), max_kv_size=16)
        calls = []

        def wanted() -> list[bool]:
            calls.append(1)
            return [True, not drop_after_first_piece, True] if len(rows) == 3 else [True] * len(rows)

        kept = run_right_padded(model, rows, cache, 0, 4, wanted)
        assert len(calls) > 1  # several pieces, the window moved during them
        nxt = mx.array([[rows[i][-1]] for i in kept])
        return model(nxt, cache=cache)[:, -1, :]

    dropped = decode_logits(bodies, drop_after_first_piece=True)
    alone = decode_logits([bodies[0], bodies[2]], drop_after_first_piece=False)
    assert dropped.shape == alone.shape
    assert mx.allclose(dropped, alone, atol=1e-4).item()
