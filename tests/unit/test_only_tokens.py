"""guided.only_tokens: the one token each row of a grammar bitmask allows, or None."""

from __future__ import annotations

import numpy as np

from mlx_parallm_provider.engine.grammar.guided import only_tokens


def _mask(rows: list[list[int]], words: int = 4) -> np.ndarray:
    bits = np.zeros((len(rows), words * 32), dtype=np.uint8)
    for i, tokens in enumerate(rows):
        bits[i, tokens] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def test_one_token_a_row_is_read_back_whatever_its_bit():
    assert only_tokens(_mask([[0], [31], [32], [127]]), 128) == [0, 31, 32, 127]  # bit 31: a negative int32 word


def test_any_row_with_none_or_several_tokens_gives_none():
    assert only_tokens(_mask([[5], [6, 7]]), 128) is None  # two bits in one word
    assert only_tokens(_mask([[5], [6, 70]]), 128) is None  # two words
    assert only_tokens(_mask([[5], []]), 128) is None  # nothing allowed
    assert only_tokens(np.full((1, 4), -1, dtype=np.int32), 128) is None  # a free row


def test_a_token_past_the_logits_is_not_taken():
    assert only_tokens(_mask([[100]]), 100) is None
