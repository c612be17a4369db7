"""How many characters one token can cover: a bound read from the vocabulary, so a text far
over the context window is refused from its length instead of tokenized first (a 10 MB
message took 13 s to tokenize before it was refused).

No token covers more characters than its vocabulary entry has: byte-level BPE spells each
byte as one character, SentencePiece spells text as it is (``<0x0A>`` is longer than the
byte it stands for), added tokens are their own text. A normalizer that composes
characters (NFC, NFKC: at most 4 code points into one) multiplies the bound; one that may
delete characters (stripping, accents, regex replacements, unknown kinds) leaves no bound.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

#: Normalizers that never shorten a text.
_KEEPING = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
#: Normalizers that compose characters, and by how much at most.
_COMPOSING = {"NFC": 4, "NFKC": 4}


def max_chars_per_token(tokenizer: Any) -> Optional[int]:
    """The most characters of text one token of ``tokenizer`` can stand for, or None when
    that cannot be bounded (or the tokenizer cannot be read)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        longest = max(map(len, hf.get_vocab()), default=0)
        backend = getattr(hf, "backend_tokenizer", hf)
        normalizer = json.loads(backend.to_str()).get("normalizer")
    except Exception:  # not a Hugging Face tokenizer: no bound
        return None
    shrink = _shrink(normalizer)
    return longest * shrink if longest and shrink else None


def _shrink(config: Any) -> Optional[int]:
    """How many times shorter ``config`` (a normalizer's JSON) can make a text; None: unbounded."""
    if config is None:
        return 1
    kind = config.get("type") if isinstance(config, dict) else None
    if kind in _KEEPING:
        return 1
    if kind in _COMPOSING:
        return _COMPOSING[kind]
    if kind == "Sequence":
        factor = 1
        for part in config.get("normalizers") or []:
            step = _shrink(part)
            if step is None:
                return None
            factor *= step
        return factor
    if kind == "Replace":  # a fixed string for a fixed string (SentencePiece's " " -> "▁")
        pattern, content = (config.get("pattern") or {}).get("String"), config.get("content")
        if isinstance(pattern, str) and isinstance(content, str) and content:
            return max(1, math.ceil(len(pattern) / len(content)))
    return None
