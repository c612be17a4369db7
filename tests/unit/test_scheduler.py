"""Scheduling policy, with plain requests (no model)."""

from __future__ import annotations

import pytest

from mlx_parallm_provider.engine.embed.request import EmbedRequest
from mlx_parallm_provider.engine.kv import KVCacheManager
from mlx_parallm_provider.engine.kv.prefix_match import common_prefix_len
from mlx_parallm_provider.engine.request import Request, ResultSink, SamplingParams
from mlx_parallm_provider.engine.scheduler import Scheduler


def roomy() -> KVCacheManager:
    """A pool no test here fills (1,023 blocks of 16 tokens)."""
    return KVCacheManager(num_blocks=1024, block_size=16)


def req(name: str, prompt_len: int, max_tokens: int = 10) -> Request:
    return Request(name, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), ResultSink())


def names(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_burst_is_prefilled_together_then_decodes() -> None:
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=1000, prefill_chunk_size=100, kv=roomy())
    for i in range(4):
        s.add(req(f"r{i}", 10 + i))
    plan = s.schedule()
    assert names(plan.prefill) == ["r0", "r1", "r2", "r3"] and plan.decode == [] and plan.chunk is None
    s.started(plan.prefill)
    plan = s.schedule()
    assert names(plan.decode) == ["r0", "r1", "r2", "r3"] and plan.prefill == []


def test_max_num_seqs_caps_admission() -> None:
    s = Scheduler(max_num_seqs=2, max_num_batched_tokens=1000, prefill_chunk_size=100, kv=roomy())
    for i in range(3):
        s.add(req(f"r{i}", 5))
    plan = s.schedule()
    assert names(plan.prefill) == ["r0", "r1"] and s.num_waiting == 1
    s.started(plan.prefill)
    assert s.schedule().prefill == []
    s.remove(plan.prefill[0])
    assert names(s.schedule().prefill) == ["r2"]


def test_token_budget_counts_padding_and_decode_rows() -> None:
    s = Scheduler(max_num_seqs=10, max_num_batched_tokens=40, prefill_chunk_size=100, kv=roomy())
    running = [req(f"run{i}", 3) for i in range(4)]
    s.started(running)
    s.add(req("a", 10))
    s.add(req("b", 20))  # a+b padded = 2 * 20 = 40 > 36 left after 4 decode rows
    plan = s.schedule()
    assert len(plan.decode) == 4 and names(plan.prefill) == ["a"]
    assert names(s.waiting) == ["b"]


def test_long_prompt_is_chunked_over_steps() -> None:
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=16, kv=roomy())
    long = req("long", 40)
    s.add(long)
    s.add(req("short", 5))
    plan = s.schedule()
    assert plan.chunk == (long, 16) and names(plan.prefill) == ["short"]
    long.num_prefilled += 16
    s.started(plan.prefill)
    plan = s.schedule()
    assert plan.chunk == (long, 16) and names(plan.decode) == ["short"]
    long.num_prefilled += 16
    assert s.schedule().chunk == (long, 8)
    s.started([long])
    assert s.chunking is None and names(s.schedule().decode) == ["short", "long"]


def test_rows_decode_from_the_step_after_their_prefill_ends_after_the_running_ones() -> None:
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=16, kv=roomy())
    long, short, later = req("long", 40), req("short", 5), req("later", 6)
    s.add(long)
    s.add(short)
    plan = s.schedule()  # long's first chunk (16 of 40) and short's whole prompt
    assert plan.chunk == (long, 16) and names(plan.prefill) == ["short"] and plan.decode == []
    s.advanced(long, 16)
    s.started(plan.prefill)
    s.add(later)
    plan = s.schedule()
    assert names(plan.decode) == ["short"] and names(plan.prefill) == ["later"]
    s.advanced(long, 16)
    s.started(plan.prefill)
    plan = s.schedule()  # long's last 8 tokens
    assert plan.chunk == (long, 8) and names(plan.decode) == ["short", "later"]
    s.advanced(long, 8)
    s.started([long])
    assert names(s.schedule().decode) == ["short", "later", "long"]


def test_the_plan_carries_the_block_tables_of_every_row_it_runs() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=16, kv=kv)
    a, b = req("a", 10), req("b", 12)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert set(plan.kv.tables) == {id(a), id(b)}
    assert plan.kv.tables[id(a)] == [kv.table(id(a))] and len(plan.kv.tables[id(a)][0]) == 3  # 10 tokens + the next one
    assert plan.kv.blocks == kv.pool.high_water() and plan.kv.blocks_ahead >= plan.kv.blocks


def test_kv_blocks_admit_in_arrival_order() -> None:
    kv = KVCacheManager(num_blocks=11, block_size=4)  # 10 usable blocks
    s = Scheduler(max_num_seqs=10, max_num_batched_tokens=1000, prefill_chunk_size=100, kv=kv)
    s.add(req("big", 26, max_tokens=40))  # 27 tokens at admission: 7 blocks
    s.add(req("small", 5, max_tokens=5))  # 2 blocks + 1 of headroom while others hold blocks: 10
    s.add(req("next", 1, max_tokens=1))  # 1 + 1 more: over
    plan = s.schedule()
    assert names(plan.prefill) == ["big", "small"] and names(s.waiting) == ["next"]
    assert not s.fits_alone(req("huge", 30, max_tokens=11)) and s.fits_alone(req("ok", 30, max_tokens=10))


def test_remove_from_any_queue() -> None:
    s = Scheduler(max_num_seqs=1, max_num_batched_tokens=100, prefill_chunk_size=4, kv=roomy())
    chunked, waiting = req("chunked", 10), req("waiting", 2)
    s.add(chunked)
    s.add(waiting)
    s.schedule()
    assert s.chunking is chunked and s.num_running == 1 and s.num_waiting == 1
    s.remove(waiting)
    s.remove(chunked)
    assert s.all_requests() == [] and s.schedule().empty


def test_admission_counts_cached_blocks_nobody_holds_as_taken() -> None:
    """A prompt whose cached prefix is idle takes those blocks from the free count (and one
    more to hold the block it copies): admitting it on its own blocks alone ran the pool dry
    inside schedule() ('6 KV blocks wanted, 5 free' killed the worker in the soak)."""
    from mlx_parallm_provider.engine.kv import KVCacheManager

    kv = KVCacheManager(num_blocks=8, block_size=4)  # 7 usable blocks
    head = list(range(100, 110))  # 10 tokens: two whole blocks and one holding 2 tokens
    kv.grow("earlier", 10)
    kv.register("earlier", head, 10)
    kv.free("earlier")  # three cached blocks, held by nobody
    s = Scheduler(8, 4096, 512, kv=kv, prefix_caching=True)
    other = Request("other", list(range(500, 506)), SamplingParams(max_tokens=4), ResultSink())
    s.add(other)
    s.started(s.schedule().prefill)  # holds 2 blocks: 5 left, 3 of them the cached ones
    late = Request("late", head + list(range(200, 206)), SamplingParams(max_tokens=4), ResultSink())
    s.add(late)
    plan = s.schedule()  # it needs 5 blocks of its own, 2 shared, 1 copied: 6 of the 5 free
    assert late not in plan.prefill and s.waiting[0] is late
    s.remove(other)
    plan = s.schedule()
    assert plan.prefill == [late] and late.num_cached == 10 and len(plan.kv.copies) == 1  # its partly shared block


def test_a_request_that_fills_the_whole_pool_is_admitted_when_it_is_alone() -> None:
    from mlx_parallm_provider.engine.kv import KVCacheManager

    kv = KVCacheManager(num_blocks=5, block_size=4)  # 16 tokens
    s = Scheduler(4, 4096, 512, kv=kv)
    whole = Request("whole", list(range(100, 115)), SamplingParams(max_tokens=1), ResultSink())  # 15 + 1 = 16
    assert s.fits_alone(whole)
    s.add(whole)
    assert s.schedule().prefill == [whole]  # no headroom asked of a request alone


def test_alone_a_prompt_skips_a_cached_prefix_it_cannot_afford() -> None:
    from mlx_parallm_provider.engine.kv import KVCacheManager

    kv = KVCacheManager(num_blocks=5, block_size=4)
    head = list(range(100, 106))  # one whole block and 2 tokens, cached, held by nobody
    kv.grow("earlier", 6)
    kv.register("earlier", head, 6)
    kv.free("earlier")
    s = Scheduler(4, 4096, 512, kv=kv, prefix_caching=True)
    big = Request("big", head + list(range(300, 309)), SamplingParams(max_tokens=1), ResultSink())  # 16 tokens
    s.add(big)
    plan = s.schedule()  # with the hit: 4 blocks + the copy's source = 5 of 4; without: 4
    assert plan.prefill == [big] and big.num_cached == 0 and not plan.kv.copies


def emb(name: str, lengths: list[int], arrival: float) -> "EmbedRequest":
    return EmbedRequest(name, [list(range(n)) for n in lengths], "mean", ResultSink(), arrival=arrival)


def test_embedding_inputs_fill_the_step_budget_in_arrival_order_with_prompts() -> None:
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=100, prefill_chunk_size=100, kv=roomy())
    early, prompt, late = emb("e0", [30, 10, 20], arrival=0.0), req("r0", 20), emb("e1", [5, 5], arrival=2.0)
    prompt.arrival = 1.0
    for r in (early, prompt, late):
        s.add(r)
    assert s.num_waiting == 3 and s.num_running == 0
    plan = s.schedule()
    # e0 first (shortest first: 3 rows x 30 = 90 of 100), then the prompt gets the 10 left (a
    # chunk), and e1, behind the prompt, waits.
    assert [(r.request_id, ix) for r, ix in plan.embed] == [("e0", [1, 2, 0])]
    assert plan.chunk == (prompt, 10) and plan.prefill == []
    s.remove(early)  # the worker retires it once its vectors are in
    plan = s.schedule()
    # The prompt's next chunk (nothing ran here, so all 20), then e1 in what is left; it holds no slot.
    assert plan.chunk == (prompt, 20) and [(r.request_id, ix) for r, ix in plan.embed] == [("e1", [0, 1])]
    assert s.num_running == 1


def test_an_embedding_input_over_the_step_budget_runs_alone() -> None:
    s = Scheduler(max_num_seqs=8, max_num_batched_tokens=50, prefill_chunk_size=50, kv=roomy())
    big = emb("e0", [10, 80], arrival=0.0)
    s.add(big)
    first = s.schedule()
    assert [ix for _, ix in first.embed] == [[0]]  # 2 x 80 > 50: the long one waits for a step of its own
    second = s.schedule()
    assert [ix for _, ix in second.embed] == [[1]] and big.num_planned == 2
    assert s.schedule().embed == []  # every input planned; it stays held until retired
    assert big in s.all_requests()


def test_a_token_ends_a_request_by_eos_stop_ids_or_length() -> None:
    from mlx_parallm_provider.engine.output import token_ending

    def take(r: Request, token: int):
        r.output_ids.append(token)
        return token_ending(r, token, {2})

    r = Request("r", [5, 6], SamplingParams(max_tokens=3, stop_token_ids=[9]), ResultSink())
    assert take(r, 7) is None and r.output_ids == [7]
    assert take(r, 2) == "stop" and r.output_ids == [7, 2]  # EOS
    assert take(Request("s", [5], SamplingParams(stop_token_ids=[9]), ResultSink()), 9) == "stop"
    ignoring = Request("i", [5], SamplingParams(max_tokens=2, ignore_eos=True), ResultSink())
    assert take(ignoring, 2) is None and take(ignoring, 2) == "length"
    last = Request("l", [5], SamplingParams(max_tokens=1), ResultSink())
    assert take(last, 2) == "stop"  # a stop token at max_tokens is a stop, not part of the answer


def test_the_scheduler_caches_prompts_when_they_start_and_answers_when_they_finish() -> None:
    """Paged KV with prefix caching: the scheduler names a request's blocks in the prefix
    store when its prefill ends (prompt) and when it finishes answered (prompt + answer, but
    the last token, whose KV was never computed); a cancelled one adds nothing more."""
    from mlx_parallm_provider.engine.kv import KVCacheManager

    kv = KVCacheManager(num_blocks=32, block_size=4)
    s = Scheduler(4, 4096, 512, kv=kv, prefix_caching=True, eos_ids=[0])
    prompt = list(range(100, 108))  # two whole blocks
    answered, cancelled = (Request(n, prompt, SamplingParams(max_tokens=20), ResultSink()) for n in ("a", "c"))
    s.add(answered)
    s.started(s.schedule().prefill)
    assert kv.match(prompt + [1], 8).tokens == 8  # its prompt, while it runs
    for token in range(200, 206):
        answered.output_ids.append(token)
    s.finish(answered, answered=True)
    assert answered.finished and answered not in s.all_requests() and kv.table(id(answered)) == []
    assert kv.match(prompt + list(range(200, 206)) + [1], 20).tokens == 12  # 13 computed: three whole blocks
    s.add(cancelled)
    plan = s.schedule()
    s.started(plan.prefill)
    for token in range(300, 306):
        cancelled.output_ids.append(token)
    s.finish(cancelled)
    assert cancelled.finished and kv.match(prompt + list(range(300, 306)) + [1], 20).tokens == 8


@pytest.mark.parametrize("a,b,n", [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2, 3, 4], [1, 2, 9, 4], 2),
                                   (list(range(100)), list(range(57)) + [0], 57)])
def test_common_prefix_len(a, b, n) -> None:
    assert common_prefix_len(a, b) == n == common_prefix_len(b, a)


def _prompt(name: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(name, prompt, SamplingParams(max_tokens=max_tokens), ResultSink())


def test_only_uncached_tokens_count_against_the_step_budget() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4)
    kv.grow("earlier", 100)
    kv.register("earlier", list(range(100)), 100)
    kv.free("earlier")  # 25 cached blocks, held by nobody
    s = Scheduler(8, 60, 200, kv=kv, prefix_caching=True)
    a, b = _prompt("a", list(range(100)) + [500, 501]), _prompt("b", list(range(100)) + [600])
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert plan.prefill == [a, b] and a.num_cached == b.num_cached == 100 and a.num_prefilled == 100
    # (2 rows x 2 uncached tokens fit a budget of 60 that 2 x 102 would not)


def test_sharers_wait_until_the_prefix_is_cached() -> None:
    s = Scheduler(8, 4096, 1000, kv=KVCacheManager(num_blocks=256, block_size=4), prefix_caching=True, min_shared_tokens=64)
    prefix = list(range(1, 201))
    group = [_prompt(f"g{i}", prefix + [1000 + i]) for i in range(4)]
    other = _prompt("other", [7] * 50)
    twins = [_prompt("t0", [9] * 20), _prompt("t1", [9] * 20)]  # one prompt, n=2: shared whole
    for r in [*group, other, *twins]:
        s.add(r)
    plan = s.schedule()
    assert names(plan.prefill) == ["g0", "other", "t0"]
    assert names(s.waiting) == ["g1", "g2", "g3", "t1"]
    s.started(plan.prefill)  # their prompts' blocks are cached
    plan = s.schedule()
    assert names(plan.prefill) == ["g1", "g2", "g3", "t1"]
    assert [r.num_cached for r in plan.prefill] == [200, 200, 200, 19]


def test_without_prefix_caching_nobody_waits_or_reuses() -> None:
    kv = roomy()
    s = Scheduler(8, 4096, 1000, kv=kv)
    rs = [_prompt(f"r{i}", list(range(300)) + [i]) for i in range(3)]
    for r in rs:
        s.add(r)
    assert s.schedule().prefill == rs and all(r.num_cached == 0 for r in rs)
    s.started(rs)
    assert kv.match(list(range(300)), 299).tokens == 0  # nothing was named for later prompts


def test_a_prefix_larger_than_the_store_is_not_waited_for() -> None:
    s = Scheduler(8, 4096, 1000, kv=roomy(), prefix_caching=True, prefix_capacity_tokens=100)
    rs = [_prompt(f"r{i}", list(range(300)) + [i]) for i in range(3)]
    for r in rs:
        s.add(r)
    assert s.schedule().prefill == rs
