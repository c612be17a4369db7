"""vLLM's token controls through the engine: ``min_tokens``, ``allowed_token_ids``,
``bad_words`` and ``skip_special_tokens``, on every decoding path (plain steps, steps decoded
ahead, n-gram verification, grammar rows), and their bad values refused at submit."""

from __future__ import annotations

import asyncio

import pytest

from engine_helpers import ScriptedModel
from mlx_parallm_provider.engine import Constraint, SamplingParams
from mlx_parallm_provider.engine.drafting import ngram
from mlx_parallm_provider.engine.sampled import plain_row
from mlx_parallm_provider.errors import InvalidParameterError

EOS = 2  # <|im_end|>, the tiny model's EOS
VOCAB = 49152
PATHS = {  # engine settings of each decoding path a row may take
    "plain": {"async_scheduling": False},
    "ahead": {"async_scheduling": True},
    "ngram": {"speculative": "ngram", "num_speculative_tokens": 4, "speculative_max_batch": 8},
}


@pytest.fixture(autouse=True)
def _every_draft_verified(monkeypatch) -> None:
    """Rows with n-gram drafts verify all of them (not as many as the step times advise)."""
    monkeypatch.setattr(ngram.NgramProposer, "plan", lambda self, rows: max((len(r.draft) for r in rows), default=0)
                        if len(rows) <= self.max_batch and all(plain_row(r) for r in rows) else 0)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture
def scripted(make_engine, tiny_model):
    """An engine whose model writes "one two three" then EOS, over and over; what it writes
    where its token is banned is the first token of the vocabulary (``<|endoftext|>``, special)."""
    script = _ids(tiny_model.tokenizer, "one two three") + [EOS]

    def factory(**config):
        return make_engine(ScriptedModel(tiny_model.model, script, vocab_size=VOCAB), **config), script

    return factory


@pytest.mark.parametrize("path", PATHS)
def test_min_tokens_holds_eos_and_stop_token_ids_back(scripted, path) -> None:
    engine, script = scripted(**PATHS[path])
    plain = engine.generate_sync(list(script), SamplingParams(max_tokens=30))
    assert plain.text == "one two three" and plain.finish_reason == "stop"
    for least in (4, 5, 7):  # (7: an n-gram draft's EOS at the 8th token, drafted after the 5th, is allowed)
        held = engine.generate_sync(list(script), SamplingParams(max_tokens=30, min_tokens=least))
        assert held.token_ids == [*script[:3], 0, *script[:3]], least  # EOS banned at the 4th token, allowed at the 8th
        assert held.text == "one two three<|endoftext|>one two three" and held.finish_reason == "stop"
    longer = engine.generate_sync(list(script), SamplingParams(max_tokens=30, min_tokens=8))
    assert longer.token_ids == [*script[:3], 0] * 2 + script[:3]
    two = script[1]
    cut = engine.generate_sync(list(script), SamplingParams(max_tokens=30, min_tokens=3, stop_token_ids=[two]))
    assert cut.token_ids == [script[0], 0, script[2]]  # a stop token id is held back too (then EOS ends it)
    assert engine.generate_sync(list(script), SamplingParams(max_tokens=3, min_tokens=3)).finish_reason == "length"
    if path == "ngram":
        assert engine.stats()["speculation"]["accepted_tokens"] > 0


@pytest.mark.parametrize("path", PATHS)
def test_min_tokens_looks_for_stop_strings_only_after_them(scripted, path) -> None:
    engine, script = scripted(**PATHS[path])
    assert engine.generate_sync(list(script), SamplingParams(max_tokens=30, stop=[" two"])).text == "one"
    held = engine.generate_sync(list(script), SamplingParams(max_tokens=30, min_tokens=5, stop=[" two"]))
    assert held.text == "one two three<|endoftext|>one" and held.finish_reason == "stop"

    async def streamed() -> str:
        return "".join([d.text async for d in engine.stream(list(script), SamplingParams(max_tokens=30, min_tokens=5, stop=[" two"]))])

    assert asyncio.run(streamed()) == held.text


def test_skip_special_tokens_leaves_their_text_out(scripted) -> None:
    engine, script = scripted()
    params = SamplingParams(max_tokens=30, min_tokens=5, skip_special_tokens=True)
    done = engine.generate_sync(list(script), params)
    assert done.text == "one two threeone two three" and 0 in done.token_ids

    async def streamed() -> str:
        return "".join([d.text async for d in engine.stream(list(script), params)])

    assert asyncio.run(streamed()) == done.text


@pytest.mark.parametrize("path", PATHS)
def test_bad_words_of_one_and_of_several_tokens(scripted, tiny_model, path) -> None:
    engine, script = scripted(**PATHS[path])
    one, two, three = script[:3]
    assert _ids(tiny_model.tokenizer, " three") == [three]
    assert engine.generate_sync(list(script), SamplingParams(max_tokens=30, bad_words=["three"])).token_ids == [one, two, 0]
    # "two three" after the output's " two": " three" is banned there (and only there)
    done = engine.generate_sync(list(script), SamplingParams(max_tokens=30, bad_words=["two three"]))
    assert done.token_ids == [one, two, 0] and done.text == "one two<|endoftext|>"
    # a word the output does not end with the rest of bans nothing
    assert engine.generate_sync(list(script), SamplingParams(max_tokens=30, bad_words=["one three"])).text == "one two three"


@pytest.mark.parametrize("path", PATHS)
def test_allowed_token_ids_keep_the_answer_within_them(make_engine, tiny_model, path) -> None:
    engine = make_engine(**PATHS[path])
    free = engine.generate_sync("hello world", SamplingParams(max_tokens=12, ignore_eos=True))
    allowed = sorted(set(free.token_ids[1:]) | {101, 2024})[:4]
    for params in (SamplingParams(max_tokens=12, allowed_token_ids=allowed, ignore_eos=True),
                   SamplingParams(max_tokens=12, allowed_token_ids=allowed, ignore_eos=True, temperature=1.0, seed=3),
                   SamplingParams(max_tokens=12, allowed_token_ids=allowed, ignore_eos=True, temperature=0.8, top_k=3, seed=4,
                                  logprobs=True, top_logprobs=2)):
        done = engine.generate_sync("hello world", params)
        assert len(done.token_ids) == 12 and set(done.token_ids) <= set(allowed), params
    ranked = engine.generate_sync("hello world", SamplingParams(max_tokens=4, allowed_token_ids=allowed, logprobs=True, top_logprobs=3))
    assert all(t in allowed for lp in ranked.logprobs for t, _, _ in lp.top_logprobs)


def test_a_row_with_controls_leaves_its_neighbours_as_they_were_alone(make_engine, tiny_model) -> None:
    engine = make_engine(async_scheduling=True, batch_window_ms=10_000, max_num_seqs=4)
    prompts = ["hello world", "the cat sat", "one two", "tell me"]
    plain = [SamplingParams(max_tokens=10, ignore_eos=True), SamplingParams(max_tokens=10, temperature=1.0, seed=9, ignore_eos=True)]
    alone = [engine.generate_sync(p, s).token_ids for p, s in zip(prompts, plain)]
    first = alone[0][0]
    controlled = [SamplingParams(max_tokens=10, min_tokens=6, bad_words=[tiny_model.tokenizer.decode([first])]),
                  SamplingParams(max_tokens=10, allowed_token_ids=[5, 6, 7], ignore_eos=True)]
    got = engine.generate_many_sync(prompts, [*plain, *controlled])
    assert [g.token_ids for g in got[:2]] == alone
    assert first not in got[2].token_ids and len(got[2].token_ids) >= 6
    assert set(got[3].token_ids) <= {5, 6, 7}


def test_a_grammar_ends_its_row_even_before_min_tokens(make_engine) -> None:
    engine = make_engine()
    done = engine.generate_sync("pick", SamplingParams(max_tokens=20, min_tokens=15, constraint=Constraint.choice(["yes", "no"])))
    assert done.text in ("yes", "no") and done.finish_reason == "stop"
    # where the grammar allows more, min_tokens holds it open
    longer = engine.generate_sync("digits", SamplingParams(max_tokens=12, min_tokens=8, constraint=Constraint.regex(r"[0-9]+")))
    assert len(longer.token_ids) >= 8 and longer.text.isdigit()


@pytest.mark.parametrize("params, field", [
    (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1, -2]), "allowed_token_ids[1]"),
    (dict(allowed_token_ids="1"), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words[0]"),
    (dict(bad_words=[3]), "bad_words[0]"),
    (dict(bad_words=["x"] * 1025), "bad_words"),
    (dict(skip_special_tokens="yes"), "skip_special_tokens"),
])
def test_bad_values_are_refused_naming_the_field(params, field) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        SamplingParams(**params)
    assert caught.value.field == field


def test_values_the_model_cannot_take_are_refused_at_submit(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(InvalidParameterError) as caught:
        engine.generate_sync("hi", SamplingParams(max_tokens=2, allowed_token_ids=[5, VOCAB]))
    assert caught.value.field == "allowed_token_ids[1]"
    with pytest.raises(InvalidParameterError) as caught:
        engine.generate_sync("hi", SamplingParams(max_tokens=2, bad_words=["   "]))
    assert caught.value.field == "bad_words[0]" and "writes no token" in str(caught.value)
    with pytest.raises(InvalidParameterError) as caught:
        engine.generate_sync("hi", SamplingParams(max_tokens=2, bad_words=["word " * 40]))
    assert caught.value.field == "bad_words[0]" and "at most 32" in str(caught.value)
    assert engine.generate_sync("hi", SamplingParams(max_tokens=2)).usage.completion_tokens == 2  # the engine still serves
