"""Prompt-lookup speculative decoding in the engine (issue 24): greedy and seeded sampled
output token for token what it is without speculation, alone and batched, streamed, with stop
strings and budgets.

The tiny random model never repeats itself, so prompt lookup would find nothing to draft:
the tests draft with an oracle instead (the plain run's next tokens, the third one wrong),
so every speculative step accepts two drafts, rejects one and rolls its KV back; and they
speculate at every step (the choice of how many drafts pay is unit-tested)."""

from __future__ import annotations

import asyncio

import pytest

from engine_helpers import EchoingModel, scrape
from mlx_parallm_provider.engine import SamplingParams
from mlx_parallm_provider.engine.drafting import ngram as speculation
from mlx_parallm_provider.engine.sampled import plain_row

PROMPTS = ["one two three one two three one two three one two", "a b c d a b c d a b", "the sea the sea the sea",
           "Write the list again: red, green, blue; red, green,"]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_model):
    """Each prompt's greedy tokens without speculation."""
    from mlx_parallm_provider.config import EngineConfig
    from mlx_parallm_provider.engine import Engine

    engine = Engine("tiny", EngineConfig(), loaded=tiny_model)
    try:
        yield [engine.generate_sync(p, PARAMS) for p in PROMPTS]
    finally:
        engine.shutdown()


@pytest.fixture
def _speculating(monkeypatch, tiny_model, plain):
    """A factory of speculating engines whose drafts come from the plain run (``.truth``:
    each prompt's tokens the oracle drafts from, by its last 4 prompt tokens)."""
    truth = {tuple(tiny_model.tokenizer.encode(p)[-4:]): r.token_ids for p, r in zip(PROMPTS, plain)}

    def oracle(self, request) -> None:
        known = truth.get(tuple(request.prompt_ids[-4:]))
        if known is None or not plain_row(request) or request.finished:
            request.draft = []
            return
        n, left = len(request.output_ids), request.params.max_tokens - len(request.output_ids) - 1
        draft = list(known[n : n + min(3, left)])
        if len(draft) == 3:
            draft[2] = (draft[2] + 1) % 1000  # rejected: the step emits the true token instead
        request.draft = draft

    monkeypatch.setattr(speculation.NgramProposer, "draft", oracle)
    monkeypatch.setattr(speculation.NgramProposer, "plan", lambda self, rows: min(self.k, max((len(r.draft) for r in rows), default=0))
                        if len(rows) <= self.max_batch and all(plain_row(r) for r in rows) else 0)

    def factory(make_engine, **config):
        return make_engine(**{"speculative": "ngram", "num_speculative_tokens": 4, "speculative_max_batch": 8, **config})

    factory.truth = truth
    return factory


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_output_is_the_same_alone_batched_and_streamed(make_engine, plain, _speculating, caching: bool) -> None:
    engine = _speculating(make_engine, enable_prefix_caching=caching)
    alone = [engine.generate_sync(p, PARAMS) for p in PROMPTS]

    async def batched():
        return await asyncio.gather(*(engine.generate(p, PARAMS) for p in PROMPTS))

    together = asyncio.run(batched())
    streamed = list(engine.stream_sync(PROMPTS[0], PARAMS))
    assert [r.token_ids for r in alone] == [r.token_ids for r in plain]
    assert [r.token_ids for r in together] == [r.token_ids for r in plain]
    assert [t for d in streamed for t in d.token_ids] == plain[0].token_ids
    assert "".join(d.text for d in streamed) == plain[0].text
    assert all(len(r.token_ids) == PARAMS.max_tokens and r.finish_reason == "length" for r in alone)
    stats = engine.stats()["speculation"]
    assert stats["speculative_steps"] > 0 and stats["acceptance_rate"] == pytest.approx(2 / 3, abs=0.1), stats
    assert stats["tokens_per_step"] > 2.5  # two accepted + the true third, but for the rows' last steps
    scraped = {k.split("{")[0]: v for k, v in scrape(engine).items()}  # /metrics counts the same
    assert scraped["vllm:spec_decode_num_drafts_total"] == stats["speculative_steps"]
    assert scraped["vllm:spec_decode_num_draft_tokens_total"] == stats["draft_tokens"]
    assert scraped["vllm:spec_decode_num_accepted_tokens_total"] == stats["accepted_tokens"]


def test_steps_too_wide_to_speculate_run_ahead_and_narrower_ones_verify_drafts(make_engine, plain, _speculating) -> None:
    """Async scheduling beside n-gram drafts (engine/decode_ahead.py): drafts depend on the
    last token, so a step that would verify them is not computed ahead; steps wider than
    ``speculative_max_batch`` are. Tokens as without either."""
    engine = _speculating(make_engine, speculative_max_batch=1, async_scheduling=True)

    async def batched():
        return await asyncio.gather(*(engine.generate(p, PARAMS) for p in PROMPTS))

    assert [r.token_ids for r in asyncio.run(batched())] == [r.token_ids for r in plain]
    assert engine._core.runner.ahead.steps > 0 and engine.stats()["speculation"]["speculative_steps"] == 0
    ahead = engine._core.runner.ahead.steps
    assert engine.generate_sync(PROMPTS[0], PARAMS).token_ids == plain[0].token_ids
    # (its first decode step has no drafts yet: the second may be computed ahead, no later one)
    assert engine.stats()["speculation"]["speculative_steps"] > 0 and engine._core.runner.ahead.steps <= ahead + 1


def test_a_stop_string_inside_accepted_drafts_ends_the_row_there(make_engine, plain, _speculating) -> None:
    engine = _speculating(make_engine)
    whole = plain[0].text
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    expected = whole[: whole.index(stop)]
    got = engine.generate_sync(PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))
    assert got.finish_reason == "stop" and got.text == expected


def test_seeded_sampled_rows_speculate_and_draw_what_they_draw_without(make_engine, tiny_model, _speculating) -> None:
    """A sampled row keeps a draft where its own draw at that position (with the key plain
    decoding uses there) is the draft: the same tokens as without speculation, and its key
    left as the kept tokens' draws leave it (a later step draws on from there)."""
    sampled = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=11 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    off = make_engine()
    expected = [off.generate_sync(p, s).token_ids for p, s in zip(PROMPTS, sampled)]
    _speculating.truth.update({tuple(tiny_model.tokenizer.encode(p)[-4:]): e for p, e in zip(PROMPTS, expected)})
    engine = _speculating(make_engine)
    alone = [engine.generate_sync(p, s).token_ids for p, s in zip(PROMPTS, sampled)]

    async def batched():
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(PROMPTS, sampled)))

    assert alone == expected
    assert [r.token_ids for r in asyncio.run(batched())] == expected
    stats = engine.stats()["speculation"]
    assert stats["speculative_steps"] > 0 and stats["acceptance_rate"] == pytest.approx(2 / 3, abs=0.1), stats


def test_rows_that_cannot_speculate_decode_as_before_beside_those_that_can(make_engine, plain, _speculating) -> None:
    engine = _speculating(make_engine)
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=7, ignore_eos=True, logprobs=True)  # logprobs: no drafts
    sampled_alone = engine.generate_sync(PROMPTS[1], sampled).token_ids

    async def mixed():
        return await asyncio.gather(engine.generate(PROMPTS[1], sampled), *(engine.generate(p, PARAMS) for p in PROMPTS))

    results = asyncio.run(mixed())
    assert results[0].token_ids == sampled_alone  # seeded sampling: reproducible
    assert [r.token_ids for r in results[1:]] == [r.token_ids for r in plain]


def test_rows_with_penalties_or_a_logit_bias_speculate_and_answer_as_without(make_engine, tiny_model, _speculating) -> None:
    """Each drafted position's penalties count the tokens before it, drafts included (a model
    that repeats a row's last token unless a penalty counts it): greedy and seeded rows with
    penalties, and a row with a logit bias, give the tokens they give without speculation,
    alone and batched."""
    params = [SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=1.2, presence_penalty=0.3),
              SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True, presence_penalty=1.5),
              SamplingParams(max_tokens=24, ignore_eos=True, logit_bias={300: 2.0})]
    model = EchoingModel(tiny_model.model, margin=0.5)
    off = make_engine(model)
    expected = [off.generate_sync(p, s).token_ids for p, s in zip(PROMPTS, params)]
    assert all(len(set(t)) > 12 for t in expected[:3])  # (the penalties moved the rows on)
    _speculating.truth.update({tuple(tiny_model.tokenizer.encode(p)[-4:]): e for p, e in zip(PROMPTS, expected)})
    engine = make_engine(model, speculative="ngram", num_speculative_tokens=4, speculative_max_batch=8)
    assert [engine.generate_sync(p, s).token_ids for p, s in zip(PROMPTS, params)] == expected

    async def batched():
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(PROMPTS, params)))

    assert [r.token_ids for r in asyncio.run(batched())] == expected
    assert engine.stats()["speculation"]["speculative_steps"] > 0


def test_a_predicted_output_is_drafted_from_and_never_changes_the_answer(make_engine, tiny_model, plain, monkeypatch) -> None:
    """OpenAI's ``prediction``: drafts follow the answer's last tokens in it (the plain run's
    own text here, so nearly all are kept); a wrong prediction only costs rejected drafts."""
    monkeypatch.setattr(speculation.NgramProposer, "plan", lambda self, rows: min(self.k, max((len(r.draft) for r in rows), default=0))
                        if len(rows) <= self.max_batch and all(plain_row(r) for r in rows) else 0)
    prompt, expected = PROMPTS[3], plain[3]
    accepted = {}
    for name, prediction in [("none", None), ("right", tiny_model.tokenizer.decode(expected.token_ids)),
                             ("wrong", {"type": "content", "content": [{"type": "text", "text": "purple, orange, "}] * 4})]:
        engine = make_engine(speculative="ngram", num_speculative_tokens=4, speculative_max_batch=8)
        got = engine.generate_sync(prompt, SamplingParams(max_tokens=24, ignore_eos=True, prediction=prediction))
        assert got.token_ids == expected.token_ids, name
        accepted[name] = engine.stats()["speculation"]["accepted_tokens"]
    assert accepted["right"] >= 12 and accepted["right"] > 2 * max(accepted["none"], accepted["wrong"]), accepted


@pytest.mark.parametrize("bad", [5, {"type": "text", "content": "x"}, {"type": "content"}, {"type": "content", "content": [{"type": "image_url"}]}])
def test_a_bad_prediction_is_refused(bad) -> None:
    from mlx_parallm_provider.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="prediction"):
        SamplingParams(prediction=bad)


def test_a_prediction_the_context_could_not_hold_or_not_text_is_refused_at_submit(make_engine) -> None:
    from mlx_parallm_provider.errors import InvalidParameterError

    engine = make_engine()
    for bad in ("word " * 200_000, "odd \ud800"):
        with pytest.raises(InvalidParameterError, match="prediction"):
            engine.generate_sync("hi", SamplingParams(max_tokens=2, prediction=bad))
    assert engine.generate_sync("hi", SamplingParams(max_tokens=2, prediction="hello")).usage.completion_tokens == 2


def test_the_prediction_benchmark_runs_its_four_ways(tiny_model_dir) -> None:
    from mlx_parallm_provider.bench.prediction import measure

    rows = measure(str(tiny_model_dir), functions=2, max_tokens=8, repeats=1)  # (raises where an answer differs)
    assert [(name, label) for name, label, _ in rows] == [("off", "none"), ("ngram", "none"), ("ngram", "the file"),
                                                           ("ngram", "the answer itself")]
    assert all(rate > 0 for _, _, rate in rows)
