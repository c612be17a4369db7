"""Prompt-lookup drafting and the choice of how many drafts pay (engine/drafting/ngram.py)."""

from __future__ import annotations

import random

import pytest

from mlx_parallm_provider.engine.drafting.ngram import MAX_NGRAM, MIN_NGRAM, NgramIndex, NgramProposer
from mlx_parallm_provider.engine.kv.manager import KVCacheManager


def _reference(tokens: list[int], k: int) -> list[int]:
    """The latest earlier occurrence of the longest suffix of MAX_NGRAM..MIN_NGRAM tokens, by scanning."""
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("seed", range(5))
def test_the_index_proposes_what_a_scan_finds(seed: int) -> None:
    rng = random.Random(seed)
    index, tokens = NgramIndex(), []
    for _ in range(300):
        new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        tokens += new
        index.extend(new)
        assert index.propose(4) == _reference(tokens, 4), tokens[-8:]


def test_drafts_copy_what_followed_the_same_words_before() -> None:
    index = NgramIndex()
    index.extend([7, 1, 2, 3, 4, 5, 9, 1, 2])
    assert index.propose(3) == [3, 4, 5]
    index.extend([8])  # "2 8" never occurred, nor did a longer run ending in 8
    assert index.propose(3) == []


class _Row:
    def __init__(self, draft: list[int]) -> None:
        self.draft = draft
        self.state = type("State", (), {"sampler": type("S", (), {"greedy": True, "processes": False, "matcher": None, "bans": None})()})()
        self.params = type("P", (), {"logprobs": False, "top_logprobs": 0})()
        self.predicted_ids: list[int] = []


def test_drafts_are_verified_only_while_they_pay() -> None:
    spec = NgramProposer(k=4, max_batch=8)
    rows = [_Row([1, 2, 3, 4])]
    assert spec.plan(rows) == 0  # no plain step measured yet
    spec.times.record(1, 0, 0.100)
    assert spec.plan(rows) == 4  # untried widths are assumed as cheap as a plain step
    for k in (1, 2, 3, 4):
        spec.times.record(1, k, 0.100 * (1 + k))  # each draft costs a whole step: never pays
    assert spec.plan(rows) == 0
    cheap = NgramProposer(k=4, max_batch=8)
    cheap.times.record(1, 0, 0.100)
    for k in (1, 2, 3, 4):
        cheap.times.record(1, k, 0.100 + 0.001 * k)  # memory-bound: drafts almost free
    assert cheap.plan(rows) == 4
    assert cheap.plan([_Row([])]) == 0 and cheap.plan([_Row([1])] * 9) == 0  # no draft / too many rows


def test_fitting_a_table_releases_the_blocks_of_rejected_drafts() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.fit("row", 6)
    free = kv.pool.num_free
    kv.fit("row", 13)  # room for 5 drafts
    assert len(kv.table("row")) == 4 and kv.pool.num_free == free - 2
    kv.fit("row", 7)  # 1 accepted: the blocks past it go back
    assert len(kv.table("row")) == 2 and kv.pool.num_free == free


def test_a_rows_drafts_come_from_its_whole_prompt_and_output_as_they_grow() -> None:
    spec = NgramProposer(k=3, max_batch=8)
    row = _Row([])
    row.prompt_ids, row.output_ids, row.finished = [7, 1, 2, 3, 4, 9], [], False
    row.params.max_tokens = 20
    for token in [1, 2, 5, 1, 2]:
        row.output_ids.append(token)
        spec.draft(row)
        assert spec._index[id(row)].tokens == row.prompt_ids + row.output_ids  # noqa: SLF001
        assert row.draft == _reference(row.prompt_ids + row.output_ids, 3)
    assert row.draft == [5, 1, 2]  # "1 2" last ended before the 5 of the output


def _looking_up(tokens: list[int], repeat: int = 3) -> _Row:
    """A row whose prompt ends with a repeat of its first ``repeat`` tokens: its lookups
    always find a draft (of ``repeat`` tokens' kind of match, in the prompt)."""
    row = _Row([])
    row.prompt_ids, row.output_ids, row.finished = tokens + tokens[:repeat], [], False
    row.params.max_tokens = 100
    return row


def test_a_row_whose_drafts_are_rejected_stops_drafting_and_holds_back_other_rows_of_its_kind_for_a_while() -> None:
    spec = NgramProposer(k=4, max_batch=8)
    spec.times.record(1, 0, 0.100)
    for k in (1, 2, 3, 4):
        spec.times.record(1, k, 0.100 + 0.005 * k)
    bad, other = _looking_up([5, 6, 7, 8, 9, 10]), _looking_up([1, 2, 3, 4], repeat=2)
    spec.draft(bad)
    assert bad.draft and spec.plan([bad]) > 0  # a new row's drafts are tried
    for _ in range(8):
        spec.record_acceptance(bad, len(bad.draft) or 4, 0)  # every draft rejected
    spec.draft(bad)
    assert bad.draft == [] and spec.plan([bad]) == 0  # it proposes none now
    spec.draft(other)
    assert other.draft and spec.plan([other]) > 0  # a later row with another kind of match is tried as a new one
    same, tries = _looking_up([11, 12, 13, 14]), 0  # bad's kind (3 tokens, in the prompt)
    while not same.draft:  # each of its matches draws the kind's rate back towards the prior
        spec.draft(same)
        tries += 1
    assert 5 <= tries <= 40 and spec.plan([same]) > 0  # so it is tried after a while
    tries = 0
    while not bad.draft:  # its lookups still match: each draws it back towards the prior
        spec.draft(bad)
        tries += 1
    assert 5 <= tries <= 40 and spec.plan([bad]) > 0  # so it tries again, after a while
    spec.forget(bad)
    assert spec.acceptance(bad) == spec.acceptance(_Row([]))  # (ids may be reused: nothing stays)


def test_a_row_that_keeps_its_drafts_is_planned_with_more_than_a_new_rows_rate() -> None:
    spec = NgramProposer(k=4, max_batch=8)
    spec.times.record(1, 0, 0.100)
    for k in (1, 2, 3, 4):
        spec.times.record(1, k, 0.100 * (1 + 0.6 * k))  # drafts cost: only likely ones pay
    row = _looking_up([1, 2, 3, 4])
    spec.draft(row)
    assert spec.plan([row]) == 0  # at the prior rate (0.5) no width pays
    for _ in range(10):
        spec.record_acceptance(row, 4, 4)
    assert spec.plan([row]) > 0


def test_the_plain_step_after_a_verify_step_is_counted_as_the_verify_steps_cost() -> None:
    """With decoding ahead, the plain step after a verify step builds its graph unoverlapped:
    what it costs over a plain step is charged to verifying, and not to plain steps."""
    from mlx_parallm_provider.engine.drafting import Drafting
    from mlx_parallm_provider.engine.plan import Drafted, StepOutput, Verify

    spec = NgramProposer(k=4, max_batch=8)
    drafts = Drafting(spec, None, spec.times)
    rows = [_Row([1, 2])]

    def step(seconds: float, verify=None) -> None:  # a step of one row, as the scheduler takes it back
        out = StepOutput(decoded=rows, decode_seconds=seconds, drafts={id(rows[0]): Drafted(1, 0, 1)} if verify else {})
        drafts.verified(rows, verify, out)

    for _ in range(3):
        step(0.100)
    for k in (1, 2):
        spec.times.record(1, k, 0.140)  # the times alone say it pays at the prior rate (0.5)
    assert spec.times.restart_cost(1) == 0.0 and spec.plan(rows) > 0  # 1.5+ tokens in 0.14 s beats 1 in 0.1 s
    step(0.140, Verify("ngram", 1))  # a verify step (its draft rejected)
    step(0.150)  # the plain step after it
    assert spec.times.get(1, 0) == 0.100  # not a plain step's time
    assert abs(spec.times.restart_cost(1) - 0.050) < 1e-12
    assert spec.plan(rows) == 0  # 1.6 tokens at most in 0.19 s lose to 1 in 0.1 s
    step(0.100)  # the next plain step is a plain step again
    assert spec.times.get(1, 0) == 0.100 and abs(spec.times.restart_cost(1) - 0.050) < 1e-12
    for _ in range(10):
        spec.record_acceptance(rows[0], 2, 2)  # a row that keeps its drafts pays for it
    assert spec.plan(rows) > 0


class _Predicting:
    """A request's fields a lookup reads: its prompt, output and predicted output."""

    def __init__(self, prompt: list[int], output: list[int], predicted: list[int]) -> None:
        self.prompt_ids, self.output_ids, self.predicted_ids = prompt, output, predicted


def test_a_predicted_output_is_drafted_from_first_then_the_prompt_and_output() -> None:
    spec = NgramProposer(k=4, max_batch=8)
    row = _Predicting([1, 2, 3, 10, 11, 99], [10, 11], predicted=[5, 10, 11, 12, 13, 14, 15])
    assert spec.lookup(row, 3) == [12, 13, 14]  # (the prompt's "10 11" is followed by 99)
    assert spec._kind_of(row) == (2, "prediction")
    row.output_ids += [12, 40]  # the answer left the prediction: "12 40" is nowhere in it
    assert spec.lookup(row, 3) == [] and spec._kind_of(row) is None
    plain = _Predicting([1, 2, 3, 10, 11, 99], [10, 11], predicted=[])
    assert spec.lookup(plain, 3) == [99, 10, 11] and spec._kind_of(plain) == (2, "prompt")
    spec.forget(row)
    assert id(row) not in spec._predicted and id(row) not in spec._matched


def test_follow_finds_the_longest_suffix_of_another_text() -> None:
    index = NgramIndex()
    index.extend([1, 2, 3, 4, 2, 3, 5, 6])
    assert index.follow([9, 1, 2, 3], 2) == [4, 2] and index.matched == (3, 3)  # "1 2 3", not the later "2 3"
    assert index.follow([7, 2, 3], 2) == [5, 6] and index.matched == (2, 6)  # the latest "2 3"
    assert index.follow([3], 2) == [] and index.follow([1, 2], 0) == []
