"""Issue 11: grammar-constrained decoding inside the batch (llguidance). The tiny model has
random weights, so whatever it emits under a constraint is valid only by construction."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from mlx_parallm_provider.engine import Constraint, SamplingParams
from mlx_parallm_provider.errors import InvalidParameterError

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 0, "maximum": 9},
                   "sunny": {"type": "boolean"}},
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}
PROMPTS = ["the weather in", "seven curious cats", "a lazy dog", "over the old wall"]
PLAIN = SamplingParams(max_tokens=10, ignore_eos=True)


def _valid(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"city", "days", "sunny"} and value["city"] in ("Paris", "Oslo", "Lima")
            and isinstance(value["days"], int) and 0 <= value["days"] <= 9 and isinstance(value["sunny"], bool))


def test_constrained_rows_always_parse_and_unconstrained_rows_are_untouched(make_engine) -> None:
    engine = make_engine()
    plain_alone = [engine.generate_sync(p, PLAIN).token_ids for p in PROMPTS]
    greedy = SamplingParams(max_tokens=40, constraint=Constraint.json_schema(SCHEMA))
    sampled = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, constraint=Constraint.json_schema(SCHEMA)) for s in range(6)]
    greedy_alone = engine.generate_sync("the weather in", greedy)

    async def mixed():
        return await asyncio.gather(
            engine.generate("the weather in", greedy),
            *(engine.generate(p, s) for p, s in zip(PROMPTS * 2, sampled)),
            *(engine.generate(p, PLAIN) for p in PROMPTS),
        )

    results = asyncio.run(mixed())
    constrained, plain = results[:7], results[7:]
    for r in constrained:
        assert r.finish_reason == "stop" and _valid(r.text), r.text
    assert constrained[0].token_ids == greedy_alone.token_ids  # batched == alone, constrained too
    assert [r.token_ids for r in plain] == plain_alone


def test_regex_and_lark_constraints(make_engine) -> None:
    engine = make_engine()
    yes_no = engine.generate_sync("answer", SamplingParams(max_tokens=10, temperature=1.0, seed=1, constraint=Constraint.regex(r"(yes|no)\.")))
    assert re.fullmatch(r"(yes|no)\.", yes_no.text) and yes_no.finish_reason == "stop"
    # Embedded JSON gets free whitespace unless its schema says otherwise (x-guidance).
    lark = Constraint.lark('start: "<call>" %json {"x-guidance": {"whitespace_flexible": false}, "type": "object", '
                           '"properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["n"], '
                           '"additionalProperties": false} "</call>"')
    call = engine.generate_sync("call", SamplingParams(max_tokens=30, constraint=lark))
    assert call.text.startswith("<call>") and call.text.endswith("</call>")
    assert 1 <= json.loads(call.text[len("<call>"):-len("</call>")])["n"] <= 5


def test_streamed_constrained_output_joins_to_the_whole(make_engine) -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=5, constraint=Constraint.json_schema(SCHEMA))
    whole = engine.generate_sync("stream", params)
    pieces = list(engine.stream_sync("stream", params))
    assert "".join(d.text for d in pieces) == whole.text and _valid(whole.text)
    assert pieces[-1].finish_reason == "stop"


def test_n_samples_under_one_constraint(make_engine) -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=11, constraint=Constraint.json_schema(SCHEMA))
    texts = [c.text for c in engine.generate_many_sync(["n samples"], params, n=4)]
    assert len(texts) == 4 and all(_valid(t) for t in texts)
    assert len(set(texts)) > 1  # seed + i: the samples differ


def test_json_object_output_is_an_object_when_it_stops(make_engine) -> None:
    engine = make_engine()
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, constraint=Constraint.json_object()) for s in range(8)]
    results = engine.generate_many_sync(["json please"] * 8, params)
    stopped = [r for r in results if r.finish_reason == "stop"]
    assert stopped, "no sample closed its object within 60 tokens"
    assert all(isinstance(json.loads(r.text), dict) for r in stopped)


def test_running_out_of_tokens_is_length_not_stop(make_engine) -> None:
    engine = make_engine()
    r = engine.generate_sync("short", SamplingParams(max_tokens=3, constraint=Constraint.json_schema(SCHEMA)))
    assert r.finish_reason == "length"


@pytest.mark.parametrize("make", [
    lambda: Constraint.regex("[a-"),
    lambda: Constraint.lark("start: undefined_rule"),
    lambda: Constraint.json_schema("{not json"),
    lambda: Constraint.json_schema(["a list"]),
    lambda: Constraint("xml", "<a/>"),
])
def test_bad_grammars_are_invalid_parameters(make) -> None:
    with pytest.raises(InvalidParameterError):
        make()


def test_constraint_must_be_a_constraint() -> None:
    with pytest.raises(InvalidParameterError, match="constraint"):
        SamplingParams(constraint={"type": "json_object"})


@pytest.mark.parametrize("constraint", [Constraint.json_schema({"$ref": "#"}), Constraint.regex(r"[^\s\S]")],
                         ids=["ref-loop", "empty-class"])
def test_a_constraint_nothing_can_satisfy_is_an_invalid_parameter(make_engine, constraint: Constraint) -> None:
    """Issue 21 item 9: it was answered as success (finish "stop", empty text); its
    neighbours in the batch are answered as without it."""
    engine = make_engine()
    alone = [engine.generate_sync(p, PLAIN).token_ids for p in PROMPTS]

    async def mixed():
        return await asyncio.gather(engine.generate("x", SamplingParams(max_tokens=10, constraint=constraint)),
                                    *(engine.generate(p, PLAIN) for p in PROMPTS), return_exceptions=True)

    bad, *plain = asyncio.run(mixed())
    assert isinstance(bad, InvalidParameterError) and bad.field == "constraint" and "no output can satisfy" in str(bad)
    assert "\n" not in str(bad)  # llguidance's matcher state is not dumped on the caller
    assert [r.token_ids for r in plain] == alone


LIST_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "scores": {"type": "array", "items": {"type": "integer"}}},
               "required": ["name", "scores"]}


@pytest.mark.parametrize("constraint", [Constraint.json_schema(LIST_SCHEMA), Constraint.json_object()], ids=["schema", "object"])
def test_json_running_out_of_tokens_is_closed_and_parses(make_engine, constraint: Constraint) -> None:
    """Issue 21 item 18: the random model never closes an array or object on its own; near
    max_tokens each row is steered onto the closing tokens, so every answer parses."""
    engine = make_engine()

    async def answers():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=m, temperature=1.0, seed=m, constraint=constraint))
                                      for p in PROMPTS for m in (12, 24, 40)))

    results = asyncio.run(answers())
    for r in results:
        value = json.loads(r.text)  # raises if cut
        assert isinstance(value, dict) and r.usage.completion_tokens <= 40
        if constraint.kind == "json_schema":
            assert isinstance(value["name"], str) and all(isinstance(x, int) for x in value["scores"])


REQUIRED_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"},
                                                    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
                   "required": ["name", "age", "ok", "tags"], "additionalProperties": False}
ITEMS_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"key": {"type": "string", "maxLength": 2}, "size": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "seen": {"type": "boolean"}},
    "required": ["key", "size", "seen"], "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False}


def test_values_that_keys_still_required_follow_are_ended_near_the_budget(make_engine) -> None:
    """Near max_tokens, a row inside a value that more required keys follow (a number, a
    string, an array short of its minItems) ends that value and goes on to the next key:
    the steering used to look only for closing brackets, which the grammar refuses there,
    and left the row free (or kept it writing digits, which matched its short values), so
    the budget cut the answer."""
    engine = make_engine()

    async def answers():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=m, temperature=1.0, seed=m + i,
                                                                        constraint=Constraint.json_schema(REQUIRED_SCHEMA)))
                                      for i, p in enumerate(PROMPTS) for m in (28, 36, 48)))

    for r in asyncio.run(answers()):
        value = json.loads(r.text)  # raises if cut
        assert set(value) == {"name", "age", "ok", "tags"} and isinstance(value["age"], int) and value["tags"], r.text


def test_a_list_near_the_budget_ends_rather_than_begin_an_item_that_would_not_fit(make_engine) -> None:
    """Where a list may end or go on, a row whose budget would not hold another item (its
    required keys included) is not given the comma: the random model, free to, began one more
    item at the end of the budget and was cut inside it."""
    engine = make_engine()

    async def answers():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=m, temperature=1.0, seed=m + i,
                                                                        constraint=Constraint.json_schema(ITEMS_SCHEMA)))
                                      for i, p in enumerate(PROMPTS) for m in range(30, 80, 7)))

    for r in asyncio.run(answers()):
        value = json.loads(r.text)  # raises if cut
        assert all(set(item) == {"key", "size", "seen"} for item in value["items"]), r.text


CALLS_GRAMMAR = (
    'start: call ("\\n" call){0,3}\n'
    'call: "<c>" %json {"x-guidance": {"whitespace_flexible": false}, "type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false} "</c>"\n'
)


def test_values_in_a_row_end_rather_than_begin_one_the_budget_would_cut(make_engine) -> None:
    """Forced tool calls are JSON values in a row (compact, as the tool-call grammar writes
    them). With fewer tokens left than the last call
    took, the row ends (EOS) instead of beginning another that the budget would cut and
    close with made-up contents (an agent would run that call): every answer is whole calls
    and ends by EOS. Before, answers ended inside a cut call or with an empty closed one."""
    engine = make_engine()
    constraint = Constraint.lark(CALLS_GRAMMAR, json_output=True)

    async def answers():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=m, temperature=1.0, seed=m, constraint=constraint))
                                      for p in PROMPTS for m in (16, 24, 40)))

    for r in asyncio.run(answers()):
        calls = r.text.split("\n")
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        for call in calls:
            assert call.startswith("<c>") and call.endswith("</c>"), r.text
            assert isinstance(json.loads(call[3:-4])["city"], str)


def test_free_text_constraints_are_never_steered(make_engine) -> None:
    engine = make_engine()
    pattern = r'[a-z "\[\]{}]+'
    r = engine.generate_sync("x", SamplingParams(max_tokens=16, ignore_eos=True, constraint=Constraint.regex(pattern)))
    assert re.fullmatch(pattern, r.text) and r.finish_reason == "length" and r.usage.completion_tokens == 16


def test_a_stop_string_inside_constrained_json_ends_it_there(make_engine) -> None:
    """Issue 21 item 13, settled as vLLM and OpenAI's API do it: stop strings apply inside a
    constraint too (the README says so), so the answer ends before the first match and is
    not valid JSON; finish_reason says "stop"."""
    engine = make_engine()
    whole = engine.generate_sync("the weather in", SamplingParams(max_tokens=40, constraint=Constraint.json_schema(SCHEMA)))
    assert _valid(whole.text) and "," in whole.text
    cut = engine.generate_sync("the weather in", SamplingParams(max_tokens=40, stop=[","], constraint=Constraint.json_schema(SCHEMA)))
    assert cut.finish_reason == "stop" and cut.text == whole.text[: whole.text.index(",")]


def test_steps_whose_rows_each_allow_one_token_give_what_masking_and_drawing_give(make_engine, monkeypatch) -> None:
    """Where every row's grammar allows one token (a schema's keys, its punctuation), the row
    takes it without the mask's and the draw's ops; greedy and seeded rows, alone and batched,
    emit the same tokens as with every step masked and drawn (the draws' keys split alike)."""
    from mlx_parallm_provider.engine import sampling

    engine = make_engine(grammar_fast_forward=False)  # (every forced token is then a step of its own)
    params = [SamplingParams(max_tokens=40, constraint=Constraint.json_schema(SCHEMA)),
              *(SamplingParams(max_tokens=40, temperature=1.0, seed=s, constraint=Constraint.json_schema(SCHEMA)) for s in range(3))]
    shortcuts = []
    only = sampling.only_tokens

    def counted(bitmask, vocab):
        shortcuts.append(only(bitmask, vocab))
        return shortcuts[-1]

    monkeypatch.setattr(sampling, "only_tokens", counted)

    async def batched():
        return [r.token_ids for r in await asyncio.gather(*(engine.generate(p, q) for p, q in zip(PROMPTS, params)))]

    alone = [engine.generate_sync(p, q).token_ids for p, q in zip(PROMPTS, params)]
    together = asyncio.run(batched())
    assert any(t is not None for t in shortcuts)  # some steps took the shortcut
    monkeypatch.setattr(sampling, "only_tokens", lambda bitmask, vocab: None)
    assert [engine.generate_sync(p, q).token_ids for p, q in zip(PROMPTS, params)] == alone
    assert asyncio.run(batched()) == together
