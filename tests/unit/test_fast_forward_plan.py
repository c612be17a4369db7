"""How many forced tokens a fast-forward step verifies (engine/drafting/forced.py): only as many as
the measured step times say pay, only for constrained rows, never in a large batch."""

from __future__ import annotations

from types import SimpleNamespace

from mlx_parallm_provider.engine.drafting.forced import ForcedProposer as FastForward
from mlx_parallm_provider.engine.drafting.step_times import StepTimes
from mlx_parallm_provider.engine.plan import Drafted


def _row(draft: list[int], constrained: bool = True) -> SimpleNamespace:
    sampler = SimpleNamespace(matcher=object() if constrained else None)
    return SimpleNamespace(draft=draft, state=SimpleNamespace(sampler=sampler))


def test_forced_tokens_are_verified_only_while_they_pay() -> None:
    times = StepTimes()
    ff = FastForward(max_batch=8, times=times)
    rows = [_row([1, 2, 3, 4, 5, 6]), _row([7, 8]), _row([], constrained=False)]
    assert ff.plan(rows) == 0  # no plain step of three rows measured yet
    times.record(3, 0, 0.100)
    assert ff.plan(rows) == 6  # untried widths are assumed as cheap as a plain step
    for k in (2, 6):
        times.record(3, k, 0.100 * (1 + k))  # each forced token costs a whole step: never pays
    assert ff.plan(rows) == 0


def _measured(seconds: dict[int, float]) -> FastForward:
    times = StepTimes()
    for k, s in seconds.items():
        times.record(3, k, s)
    return FastForward(max_batch=8, times=times)


def test_the_width_with_most_tokens_a_second_is_chosen() -> None:
    rows = [_row([1, 2, 3, 4, 5, 6]), _row([7, 8]), _row([], constrained=False)]
    assert _measured({0: 0.100, 2: 0.101, 6: 0.300}).plan(rows) == 2  # memory-bound to 3 tokens a row, then not
    assert _measured({0: 0.100, 2: 0.101, 6: 0.102}).plan(rows) == 6  # memory-bound throughout


def test_no_fast_forward_without_constrained_drafts_or_in_a_large_batch() -> None:
    times = StepTimes()
    ff = FastForward(max_batch=2, times=times)
    for n in (1, 3):
        times.record(n, 0, 0.1)
    assert ff.plan([_row([])]) == 0
    assert ff.plan([_row([5, 6], constrained=False)]) == 0  # an n-gram draft is not fast-forward's
    assert ff.plan([_row([5, 6])]) == 2
    assert ff.plan([_row([5, 6])] * 3) == 0  # more rows than max_batch


def test_widths_and_row_counts_not_yet_measured_are_estimated_from_those_that_were() -> None:
    # Eight rows of tool calls over a long cached prompt: a verify step gathers every row's KV
    # and costs several plain steps. Each untried width (and each row count, as rows finished) was
    # tried once before, and those trials cost more than fast-forward saved (0.67x).
    times = StepTimes()
    times.record(8, 0, 0.065)
    times.record(8, 3, 0.300)
    assert abs(times.estimate(8, 2) - (0.065 + 0.235 * 2 / 3)) < 1e-9  # between the plain step and a wider width
    assert times.estimate(8, 12) == 0.300  # past the widest: its cost (mostly fixed), so tried once
    ff = FastForward(max_batch=8, times=times)
    assert ff.plan([_row(list(range(3)))] * 8) == 0
    assert ff.plan([_row(list(range(12)))] * 8) == 12  # ~60 tokens for 0.3 s might pay: tried once
    times.record(8, 12, 1.000)
    assert ff.plan([_row(list(range(12)))] * 8) == 0 and ff.plan([_row(list(range(7)))] * 8) == 0  # 7: bounded by 12's cost
    times.record(7, 0, 0.060)
    assert abs(times.estimate(7, 3) - 0.060 * 0.300 / 0.065) < 1e-9  # the nearest row count's ratio
    assert ff.plan([_row(list(range(3)))] * 7) == 0
    assert times.estimate(7, 5) is None and times.estimate(6, 3) is None  # nothing says: tried once
    cheap = StepTimes()  # two rows: a verify step costs little more than a plain one
    cheap.record(2, 0, 0.030)
    cheap.record(2, 2, 0.060)
    assert FastForward(max_batch=8, times=cheap).plan([_row(list(range(10)))] * 2) == 10


def test_ragged_steps_are_measured_by_their_rows_mean_draft() -> None:
    # Two of eight rows with ten forced tokens: padded to the widest, the step computes 8 x 11
    # positions and does not pay; where verify steps compute real positions only (the CPU's
    # decoder-layer op), it costs what a step of 3 tokens a row costs, and pays.
    rows = [_row(list(range(10)))] * 2 + [_row([])] * 6
    times = StepTimes()
    times.record(8, 0, 0.050)
    times.record(8, 8, 0.200)
    ff = FastForward(max_batch=8, times=times)
    assert times.width([10, 10, 0, 0, 0, 0, 0, 0], 10) == 10 and ff.plan(rows) == 0
    times.ragged = True
    assert times.width([10, 10, 0, 0, 0, 0, 0, 0], 10) == 3 and times.width([10, 10, 0, 0, 0, 0, 0, 0], 4) == 1
    assert ff.plan(rows) == 10


class _Matcher:
    """A grammar that forces nothing and accepts any looked-up tokens."""

    def forced(self, limit: int) -> list[int]:
        return []

    def allowed_prefix(self, tokens: list[int]) -> list[int]:
        return tokens


def _looking_up(tokens: list[int], repeat: int = 3) -> SimpleNamespace:
    """A constrained row whose prompt ends with a repeat of its first ``repeat`` tokens (its
    lookups find a draft, of that many tokens' kind of match)."""
    sampler = SimpleNamespace(matcher=_Matcher(), processes=False)
    return SimpleNamespace(draft=[], state=SimpleNamespace(sampler=sampler), params=SimpleNamespace(max_tokens=50, logprobs=False),
                           prompt_ids=tokens + tokens[:repeat], output_ids=[], predicted_ids=[], finished=False, request_id="r")


def test_looked_up_drafts_plan_by_their_rows_own_acceptance() -> None:
    from mlx_parallm_provider.engine.drafting.ngram import NgramProposer

    times = StepTimes()
    ngram = NgramProposer(k=4, max_batch=8, times=times)
    ff = FastForward(max_batch=8, times=times, lookup=ngram, lookup_limit=4)
    times.record(1, 0, 0.100)
    for k in (1, 2, 3, 4):
        times.record(1, k, 0.100 + 0.005 * k)
    bad, fresh = _looking_up([5, 6, 7, 8, 9]), _looking_up([1, 2, 3, 4], repeat=2)  # (another kind of match)
    ff.draft_all([bad])
    assert bad.draft and ff.plan([bad]) > 0
    drafted = len(bad.draft)
    for _ in range(8):  # every looked-up draft rejected
        ff.verified(bad, Drafted(len(bad.draft), 0, 1))
    ff.draft_all([bad])
    assert bad.draft == [] and ff.plan([bad]) == 0  # it looks up no drafts now
    ff.draft_all([fresh])
    assert fresh.draft and ff.plan([fresh]) > 0  # a later row is not held back by it
    assert ff.stats.as_dict()["lookup_tokens"] == 8 * drafted and ff.stats.as_dict()["lookup_accepted_tokens"] == 0
