"""Ending constrained JSON within the token budget (engine/grammar/closing.py): the walk that
measures how far a row is from where its grammar may end, and when the gauge steers."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_parallm_provider.engine import Constraint
from mlx_parallm_provider.engine.grammar.closing import CLOSING_SLACK, CLOSING_WALK, ClosingGauge, JsonNesting, closing_length, continuing_length

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"}},
          "required": ["a", "b", "c"], "additionalProperties": False}


@pytest.fixture
def walk(tiny_model):
    """(text, schema) -> (closing length, whether the walk left the matcher where it was)."""
    from mlx_parallm_provider.engine.grammar.guided import GrammarTokenizer

    tok = tiny_model.tokenizer
    grammar = GrammarTokenizer(tok, 49152, [tok.eos_token_id])
    masks = grammar.closing_bits((49152 + 31) // 32)

    def measure(text: str, schema: dict, going_on: bool = False) -> tuple[int, bool]:
        matcher = grammar.matcher(Constraint.json_schema(schema).grammar())
        nesting = JsonNesting()
        ids = tok.encode(text, add_special_tokens=False)
        assert matcher.consume_tokens(ids), text
        for token in ids:
            nesting.feed(grammar.token_bytes(token))
        before = (matcher.compute_bitmask(), matcher.compute_ff_tokens(), nesting.open, nesting.in_string)
        if going_on:
            length = continuing_length(matcher, nesting, masks, 49152, grammar.token_bytes, np.frombuffer(before[0], dtype=np.int32)[:1536])
        else:
            length = closing_length(matcher, nesting, masks, 49152, grammar.token_bytes)
        after = (matcher.compute_bitmask(), matcher.compute_ff_tokens(), nesting.open, nesting.in_string)
        return length, before == after

    return measure


def test_the_walk_counts_the_required_keys_still_to_come_and_leaves_the_matcher_as_it_was(walk) -> None:
    done, kept_done = walk('{"a": "x", "b": 1, "c": true}', SCHEMA)
    in_number, kept_number = walk('{"a": "x", "b": 12', SCHEMA)  # ', "c": true}' still to come
    in_string, kept_string = walk('{"a": "Par', SCHEMA)  # '", "b": 0, "c": true}'
    assert done == 0 and kept_done and kept_number and kept_string
    # each way is at least its characters' tokens as this tokenizer writes them at best, and
    # at most one token a character
    assert 4 <= in_number <= len(', "c": true}') and in_number < in_string <= len('", "b": 0, "c": true}')


def test_going_on_in_a_list_counts_the_next_item_and_its_required_keys(walk) -> None:
    items = {"type": "object", "properties": {"xs": {"type": "array", "items": {
        "type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "integer"}}, "required": ["k", "v"], "additionalProperties": False}}},
             "required": ["xs"], "additionalProperties": False}
    close, _ = walk('{"xs": [{"k": "a", "v": 1}', items)  # ']}'
    going_on, kept = walk('{"xs": [{"k": "a", "v": 1}', items, going_on=True)  # ', {"k": "", "v": 0}]}'
    # ',' '{"' 'k' '":' ' ""' ',' ' "' 'v' '":' ' ' '0' '}' at best: 12 tokens more
    assert kept and 1 <= close <= 2 and close + 12 <= going_on <= close + len(', {"k": "", "v": 0}')
    assert walk('{"xs": [', items, going_on=True) == (None, True)  # no comma allowed before an item


def test_a_way_longer_than_the_walk_counts_as_the_walk(walk) -> None:
    long_string = {"type": "object", "properties": {"a": {"type": "string", "minLength": 200}}, "required": ["a"]}
    assert walk('{"a": "x', long_string) == (CLOSING_WALK, True)


def test_the_gauge_steers_within_reach_measures_seldom_and_holds_until_reset() -> None:
    calls: list[int] = []
    nesting = JsonNesting()
    nesting.feed(b'{"a": "')

    def measure() -> int:
        calls.append(left)
        return 10  # the row's closing length stays 10 while it writes its string

    gauge = ClosingGauge()
    steered = []
    for left in range(60, 0, -1):
        steered.append(gauge.must_close(left, nesting, measure))
    first = 60 - steered.index(True)
    assert first == 10 + CLOSING_SLACK and all(steered[60 - first:])
    assert len(calls) <= 8, calls  # halving the distance each time, not a walk a token
    gauge.reset()
    assert not gauge.steering
    left = 30
    assert not gauge.must_close(30, nesting, measure)
    assert gauge.must_close(12, nesting, measure) and not gauge.must_close(40, nesting, measure)  # rewound: measured again


def test_a_deeper_level_is_measured_at_once() -> None:
    nesting = JsonNesting()
    nesting.feed(b'{"a": ')
    lengths = iter([5, 30])
    gauge = ClosingGauge()
    assert not gauge.must_close(50, nesting, lambda: next(lengths))
    nesting.feed(b'[{"x": ')  # an array of objects opened: its required keys lengthen the way out
    assert gauge.must_close(31, nesting, lambda: next(lengths))


def test_closing_masks_sort_tokens_by_what_they_end(tiny_model) -> None:
    from mlx_parallm_provider.engine.grammar.guided import GrammarTokenizer

    tok = tiny_model.tokenizer
    grammar = GrammarTokenizer(tok, 49152, [tok.eos_token_id])
    masks = grammar.closing_bits((49152 + 31) // 32)
    (quote, quote_on), (closers, separators, values) = masks.in_string, masks.outside

    def has(mask: np.ndarray, text: str) -> bool:
        [token] = tok.encode(text, add_special_tokens=False)
        return bool((int(mask[token // 32]) >> (token % 32)) & 1)

    assert has(quote, '"') and not has(quote, '",') and has(quote_on, '",')
    assert has(closers, "}") and not has(closers, ",") and has(separators, ",") and has(separators, "},")
    assert has(values, " true") and has(values, "0") and not has(values, ",")
    assert has(masks.going_on, ",") and has(masks.going_on, "},") and has(masks.going_on, ',"') and not has(masks.going_on, '",')
    from_string = masks.going_on_from_string
    assert has(from_string, '",') and has(from_string, '"},') and not has(from_string, '"}') and not has(from_string, ",")


def test_in_a_string_a_token_that_ends_the_item_and_goes_on_is_left_out_where_the_next_would_not_fit(tiny_model, monkeypatch) -> None:
    """'"},' closes a string, its object and goes on to the next item at once, so the list
    guard looks at it from inside the string too (it looked only between values, and the model
    went on from the last string of an item into one the budget then cut). Measured once a
    string: what follows the closing quote does not depend on the text."""
    from mlx_parallm_provider.engine.grammar import guided

    tok = tiny_model.tokenizer
    grammar = guided.GrammarTokenizer(tok, 49152, [tok.eos_token_id])
    masks = grammar.closing_bits(1536)
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}}, "required": ["city", "country"]}}},
              "required": ["items"]}
    row = guided.RowMatcher(Constraint.json_schema(schema), grammar)
    for token in tok.encode('{"items": [{"city": "Oslo", "country": "Nor', add_special_tokens=False):
        row.consume(token)
    allowed = np.frombuffer(row.matcher.compute_bitmask(), dtype=np.int32)[:1536].copy()

    def has(mask: np.ndarray, text: str) -> bool:
        [token] = tok.encode(text, add_special_tokens=False)
        return bool((int(mask[token // 32]) >> (token % 32)) & 1)

    assert has(allowed, '"},') and has(allowed, '"}') and has(allowed, "way")
    walks, measure = [], guided.continuing_length
    monkeypatch.setattr(guided, "continuing_length", lambda *a: walks.append(a) or measure(*a))
    row.tokens_left = 40  # room for another item: left as it is
    assert row.steered(allowed, masks, 49152) is None
    row.tokens_left = 8  # '"}]}' fits, another item (two required keys) does not
    kept = row.steered(allowed, masks, 49152)
    assert kept is not None and not has(kept, '"},') and has(kept, '"}') and has(kept, "way")
    assert len(walks) == 1  # the same string: measured once
