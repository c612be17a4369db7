"""Grammar fast-forward (issue 24): constrained rows verify their grammar's forced tokens in one
forward, and emit exactly what they emit without it: greedy, seeded sampled, with logprobs,
batched beside unconstrained rows, streamed, cut by a stop string or by max_tokens."""

from __future__ import annotations

import asyncio

import pytest

from engine_helpers import scrape
from mlx_parallm_provider.engine import Constraint, SamplingParams
from mlx_parallm_provider.engine.grammar.guided import RowMatcher

SCHEMA = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"},
                   "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                                 "unit": {"enum": ["celsius", "fahrenheit"]}},
                                 "required": ["city", "unit"], "additionalProperties": False}},
    "required": ["name", "arguments"], "additionalProperties": False,
}
CALL = Constraint.json_schema(SCHEMA)
PROMPTS = ["the weather in", "a lazy dog", "over the wall", "seven cats"]
PARAMS = [
    SamplingParams(max_tokens=48, constraint=CALL),
    SamplingParams(max_tokens=48, temperature=0.9, seed=3, constraint=CALL),
    SamplingParams(max_tokens=48, temperature=0.9, seed=4, constraint=CALL, logprobs=True, top_logprobs=2),
    SamplingParams(max_tokens=48, constraint=CALL, stop=['"unit']),  # a stop string inside a forced run
    SamplingParams(max_tokens=7, constraint=CALL),  # the budget ends inside a forced run
    SamplingParams(max_tokens=12, ignore_eos=True),  # unconstrained, beside them
]


def _run(engine) -> list:
    """Each request alone, then all of them batched, then the first streamed."""
    alone = [engine.generate_sync(p, s) for p, s in zip(PROMPTS * 2, PARAMS)]

    async def together():
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(PROMPTS * 2, PARAMS)))

    streamed = list(engine.stream_sync(PROMPTS[1], PARAMS[1]))
    return [*alone, *asyncio.run(together()), streamed]


def _same(a, b) -> None:
    """Two runs' results agree token for token (and in text, finish reason and logprobs)."""
    assert len(a) == len(b) == 2 * len(PARAMS) + 1
    *whole_a, stream_a = a
    *whole_b, stream_b = b
    for x, y in zip(whole_a, whole_b):
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
        if x.logprobs is not None:  # (the logits of a several-token forward differ in rounding only)
            assert [(p.token_id, [t for t, _, _ in p.top_logprobs]) for p in x.logprobs] == \
                   [(p.token_id, [t for t, _, _ in p.top_logprobs]) for p in y.logprobs]
            assert [p.logprob for p in x.logprobs] == pytest.approx([p.logprob for p in y.logprobs], abs=1e-4)
    assert [t for d in stream_a for t in d.token_ids] == [t for d in stream_b for t in d.token_ids]
    assert "".join(d.text for d in stream_b) == whole_b[1].text


@pytest.fixture(scope="module")
def without(tiny_model):
    """The requests' results with fast-forward off."""
    from mlx_parallm_provider.config import EngineConfig
    from mlx_parallm_provider.engine import Engine

    engine = Engine("tiny", EngineConfig(grammar_fast_forward=False), loaded=tiny_model)
    try:
        assert engine.stats()["fast_forward"] is None
        yield _run(engine)
    finally:
        engine.shutdown()


def test_forced_tokens_are_fast_forwarded_and_output_is_unchanged(make_engine, without) -> None:
    engine = make_engine(speculative_max_batch=8)  # on by default (8 rows: batched, as the requests run)
    got = _run(engine)
    _same(without, got)
    assert got[3].finish_reason == "stop" and '"unit' not in got[3].text and got[3].text.startswith('{"name": "get_weather"')
    assert len(got[4].token_ids) == 7 and got[4].finish_reason == "length"
    stats = engine.stats()["fast_forward"]
    # The schema's keys and the tool's name are forced: whole runs of them go in one step.
    assert stats["fast_forward_steps"] > 0 and stats["accepted_tokens"] >= 40, stats
    assert stats["acceptance_rate"] == 1.0 and stats["tokens_per_row_step"] > 3, stats
    scraped = {k.split("{")[0]: v for k, v in scrape(engine).items()}  # /metrics counts the same
    assert scraped["vllm:grammar_fast_forward_steps_total"] == stats["fast_forward_steps"]
    assert scraped["vllm:grammar_fast_forward_forced_tokens_total"] == stats["forced_tokens"]
    assert scraped["vllm:grammar_fast_forward_accepted_tokens_total"] == stats["accepted_tokens"]
    assert scraped["vllm:spec_decode_num_drafts_total"] == 0  # n-gram speculation is off


def test_a_draft_the_model_would_not_choose_is_rejected_for_the_row_s_own_choice(make_engine, without, monkeypatch) -> None:
    """Drafts are verified, not trusted: with the last of every run of forced tokens replaced
    by another token, each row still emits what it emits without fast-forward."""
    forced = RowMatcher.forced

    def wrong_last(self, limit: int) -> list[int]:
        tokens = forced(self, limit)
        return tokens[:-1] + [(tokens[-1] + 1) % 1000] if len(tokens) > 1 else tokens

    monkeypatch.setattr(RowMatcher, "forced", wrong_last)
    engine = make_engine(enable_prefix_caching=False, speculative_max_batch=8)
    _same(without, _run(engine))
    stats = engine.stats()["fast_forward"]
    assert 0.5 < stats["acceptance_rate"] < 1.0 and stats["accepted_tokens"] > 0, stats


def test_with_ngram_speculation_rows_nothing_forces_verify_looked_up_drafts(make_engine, without, monkeypatch) -> None:
    """With ``speculative="ngram"`` a constrained row that nothing forces drafts from the n-gram
    lookup, cut to what its grammar accepts, and verifies it like forced tokens: output
    unchanged, sampled rows included. The lookup here is an oracle (the row's own answer,
    every third token wrong), so acceptance does not hang on the random model's repeats."""
    from mlx_parallm_provider.engine.drafting.ngram import NgramProposer

    answers = {}
    for (prompt, params), got in zip(zip(PROMPTS * 2, PARAMS), without[: len(PARAMS)]):
        answers[(prompt, params.seed, params.max_tokens)] = got.token_ids
    engine = make_engine(speculative="ngram", num_speculative_tokens=4, speculative_max_batch=8)

    def oracle(self, request, k: int) -> list[int]:
        prompt = next(p for p in PROMPTS if engine.encode(p) == request.prompt_ids[-len(engine.encode(p)):])
        known = answers[(prompt, request.params.seed, request.params.max_tokens)]
        n = len(request.output_ids)
        draft = list(known[n : n + k])
        return [t if (n + i) % 3 else (t + 1) % 1000 for i, t in enumerate(draft)]

    monkeypatch.setattr(NgramProposer, "lookup", oracle)
    _same(without, _run(engine))
    stats = engine.stats()["fast_forward"]
    assert stats["lookup_tokens"] > 0 and 0 < stats["lookup_accepted_tokens"] < stats["lookup_tokens"], stats
    assert stats["forced_tokens"] > 0  # forced runs still go first


@pytest.mark.parametrize("split", [True, False], ids=["head-apart", "whole-model"])
def test_verify_steps_compute_logits_only_where_they_are_sampled(make_engine, without, monkeypatch, split) -> None:
    """A verify step's forced positions (one allowed token, no logprobs or processors) and
    its padding need no logits: where the model splits at its head, the head runs on the
    sampled positions only; where it does not, the whole model's logits are indexed. Output
    unchanged either way."""
    from mlx_parallm_provider.engine import runner

    at = runner.SpotLogits.at
    asked, computed = [], {}

    def counting(self, spots):
        asked.append(len(spots))
        computed[id(self)] = self.out.shape[0] * self.out.shape[1]  # the pass's positions
        assert (self.head is not None) == split and (self.out.shape[-1] != self.vocab) == split
        return at(self, spots)

    monkeypatch.setattr(runner.SpotLogits, "at", counting)
    if not split:
        monkeypatch.setattr(runner, "split_head", lambda model: None)
    engine = make_engine(speculative_max_batch=8)
    _same(without, _run(engine))
    assert engine.stats()["fast_forward"]["fast_forward_steps"] > 0 and asked
    assert sum(asked) < sum(computed.values()) / 3, (asked, computed)  # most positions of those passes were forced
