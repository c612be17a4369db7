"""Token bans (``min_tokens``, ``allowed_token_ids``, ``bad_words``) for a batch at once equal
each row's bans applied alone, and bad words are tokenized as vLLM tokenizes them."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_parallm_provider.engine.token_bans import MAX_BAD_WORD_TOKENS, TokenBans, bad_word_ids, banned, held_open
from mlx_parallm_provider.errors import InvalidParameterError

pytestmark = pytest.mark.gpu

VOCAB = 64


def _alone(row: np.ndarray, bans: TokenBans | None, tail: list[int], produced: int) -> np.ndarray:
    """One row through its bans, the plain way."""
    out = row.astype(np.float32).copy()
    if bans is None:
        return out
    if bans.allowed is not None:
        keep = np.full(VOCAB, -np.inf, dtype=np.float32)
        keep[bans.allowed] = out[bans.allowed]
        out = keep
    out[bans.words_ending(tail)] = -np.inf
    if produced < bans.min_tokens:
        held = out.copy()
        held[bans.stop_ids] = -np.inf
        out = held if np.isfinite(held).any() else out
    return out


ROWS = [  # (bans, output tail, output tokens so far)
    (None, [], 0),
    (TokenBans(min_tokens=3, stop_ids=[2, 7]), [], 1),
    (TokenBans(min_tokens=3, stop_ids=[2, 7]), [5, 6, 9], 3),  # (no longer held)
    (TokenBans(allowed=[1, 2, 40]), [], 0),
    (TokenBans(bad_words=[[9], [4, 5, 6], [5, 8]]), [3, 4, 5], 3),  # 6 banned (after 4 5), 9 always, 8 not (5 is not last)
    (TokenBans(bad_words=[[4, 5, 6]]), [5], 1),  # the tail is too short for the prefix: nothing
    (TokenBans(min_tokens=5, stop_ids=[2], allowed=[2]), [], 0),  # only a stop token is left: the row may end
    (TokenBans(min_tokens=5, stop_ids=[2], allowed=[2, 11], bad_words=[[11]]), [], 0),  # the same, by a bad word
]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_batch_is_banned_as_each_row_alone(dtype) -> None:
    logits = (mx.random.normal((len(ROWS), VOCAB), key=mx.random.key(0)) * 3).astype(dtype)
    got = held_open(banned(logits, [b for b, _, _ in ROWS], [t for _, t, _ in ROWS]), [b for b, _, _ in ROWS], [n for _, _, n in ROWS])
    assert got.dtype == dtype
    plain = np.array(logits.astype(mx.float32))
    for i, (bans, tail, produced) in enumerate(ROWS):
        want = _alone(plain[i], bans, tail, produced)
        np.testing.assert_array_equal(np.array(got[i].astype(mx.float32)), want, err_msg=str(i))
    assert math.isinf(got[1, 7].item()) and not math.isinf(got[2, 7].item())
    assert np.isfinite(np.array(got[6].astype(mx.float32))).sum() == 1  # (only the EOS: the row ends there)


def test_bans_outside_the_logits_are_refused_not_scattered() -> None:
    logits = mx.zeros((2, VOCAB))
    with pytest.raises(ValueError, match="outside"):
        banned(logits, [None, TokenBans(allowed=[VOCAB])], [[], []])
    with pytest.raises(ValueError, match="outside"):
        held_open(logits, [TokenBans(min_tokens=2, stop_ids=[VOCAB + 3]), None], [0, 0])


class _Words:
    """A tokenizer of a few texts."""

    ids = {"no": [1], " no": [101], "hi there": [3, 4], " hi there": [103, 4], "odd": [7], " odd": [8, 7],
           "same": [6], " same": [6], "  ": [], " ": []}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        assert add_special_tokens is False
        return self.ids.get(text, [9] * len(text))


def test_bad_words_are_tokenized_alone_and_after_a_space_as_vllm_does() -> None:
    assert bad_word_ids(_Words(), ["no", "  hi there"]) == [[1], [101], [3, 4], [103, 4]]
    assert bad_word_ids(_Words(), ["odd", "same"]) == [[7], [6]]  # (spaced: more tokens, or the same first one)
    with pytest.raises(InvalidParameterError, match="writes no token") as caught:
        bad_word_ids(_Words(), ["no", "  "])
    assert caught.value.field == "bad_words[1]"
    with pytest.raises(InvalidParameterError, match=f"at most {MAX_BAD_WORD_TOKENS}"):
        bad_word_ids(_Words(), ["y" * (MAX_BAD_WORD_TOKENS + 1)])
