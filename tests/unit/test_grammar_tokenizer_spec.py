"""llguidance gets the tokenizer's JSON without padding or truncation, and the engine's own
tokenizer is left as it is."""

from __future__ import annotations

import json

from tokenizers import Tokenizer, models, pre_tokenizers

from mlx_parallm_provider.engine.grammar.guided import _unpadded_spec


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[PAD]": 2}, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def test_a_tokenizer_without_padding_is_read_as_it_is() -> None:
    tok = _tokenizer()
    assert _unpadded_spec(tok) == tok.to_str()


def test_padding_and_truncation_are_dropped_from_the_spec_only() -> None:
    tok = _tokenizer()
    tok.enable_padding(pad_id=2, pad_token="[PAD]", length=8)
    tok.enable_truncation(4)
    spec = json.loads(_unpadded_spec(tok))
    assert spec["padding"] is None and spec["truncation"] is None
    assert tok.padding is not None and tok.truncation is not None  # the caller's tokenizer keeps them
    rebuilt = Tokenizer.from_str(json.dumps(spec))
    assert rebuilt.encode("a b a b a b").ids == [0, 1, 0, 1, 0, 1] != tok.encode("a b a b a b").ids
