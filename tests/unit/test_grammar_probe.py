"""What a failed grammar's request is told (engine/grammar/probe.py): llguidance's cause in
one line, without its parser state, the tokenizer's special tokens or its own advice."""

from __future__ import annotations

from mlx_parallm_provider.engine.grammar.probe import describe, failure, grammar_error
from mlx_parallm_provider.errors import InvalidParameterError


def test_the_cause_is_one_line_without_parser_state_or_token_lists() -> None:
    special = ('at 1(8): unknown special token: "<|x|>"; following special tokens are available: '
               + "\u27e6<|endoftext|>\u2027<reponame>\u27e7\n   1 | start: <|x|>\n         ^\n")
    assert describe(special) == 'at 1(8): unknown special token: "<|x|>"'
    assert describe("NoExtensionBias\n<non-verbose/>").startswith("NoExtensionBias; nothing the grammar allows")
    assert describe("") == "unknown error"
    assert "\n" not in describe("x\n" * 1000) and len(describe("y" * 10_000)) <= 300


def test_llguidance_advice_is_replaced_by_a_hint_that_names_the_likely_cause() -> None:
    endless = "parser error: Too many items (limit 50000; ff_tokens); try avoiding single-byte/short lexemes\n<non-verbose/>"
    assert describe(endless) == ("parser error: Too many items (limit 50000; ff_tokens); no output of finite length matches: "
                                 "does a required $ref or rule recurse with no way out?")
    wide = "Parser Error: Current row has 30001 items; max is 2000; consider making your grammar left-recursive"
    assert describe(wide).startswith("Parser Error: Current row has 30001 items; max is 2000; too many alternatives")
    assert "too ambiguous" in describe("parser error: Too many items (limit 50000; mask); try avoiding short lexemes")


def test_the_message_says_when_the_grammar_failed() -> None:
    assert failure("boom", 0, built=False) == "cannot be used with this model's tokenizer (boom)"
    assert failure("boom", 0) == "no output can satisfy it (boom)"
    assert failure("boom", 1) == "the grammar fails after 1 token of output (boom)"
    error = grammar_error("boom", 7)
    assert isinstance(error, InvalidParameterError) and error.field == "constraint"
    assert str(error) == "constraint: the grammar fails after 7 tokens of output (boom)"
