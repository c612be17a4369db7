"""The tokenizer converted from the GGUF agrees with the GGUF's own vocabulary and merges."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import regex

from mlx_parallm_provider.models.gguf.tokenizer import _GPT2_REGEX

SAMPLES = [
    "Hello, world! What is the capital of France?",
    "déjà vu, naïve café, Ångström, Œuvre",
    "emoji: 😀👍🏽 🇫🇷 family: 👨‍👩‍👧",
    "中文测试：北京是中国的首都。日本語のテキスト、한국어",
    "numbers 1234567 and 3.14159, x=42;",
    "code:\n    def f(x):\n\treturn x ** 2  # comment\n\n\n",
    "trailing spaces   \n  leading",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class ReferenceBPE:
    """A plain-Python byte-level BPE straight from GGUF metadata (llama.cpp 'smollm' pre-split)."""

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int]) -> None:
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.specials = [tokens[i] for i, kind in enumerate(token_types) if kind == 3]
        self.byte_map = _bytes_to_unicode()
        self.special_re = regex.compile("(" + "|".join(map(regex.escape, self.specials)) + ")")
        self.digit_re = regex.compile(r"\p{N}")
        self.word_re = regex.compile(_GPT2_REGEX)

    @staticmethod
    def _isolate(pattern: regex.Pattern, text: str) -> list[str]:
        pieces, last = [], 0
        for m in pattern.finditer(text):
            if m.start() > last:
                pieces.append(text[last : m.start()])
            pieces.append(m.group())
            last = m.end()
        if last < len(text):
            pieces.append(text[last:])
        return pieces

    @lru_cache(maxsize=None)
    def _bpe(self, word: str) -> tuple[str, ...]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            rank, i = min(pairs)
            if rank == float("inf"):
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return tuple(parts)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for chunk in self.special_re.split(text):
            if not chunk:
                continue
            if chunk in self.specials:
                ids.append(self.vocab[chunk])
                continue
            for piece in self._isolate(self.digit_re, chunk):
                for word in self._isolate(self.word_re, piece):
                    mapped = "".join(self.byte_map[b] for b in word.encode("utf-8"))
                    ids.extend(self.vocab[p] for p in self._bpe(mapped))
        return ids


@pytest.fixture(scope="module")
def reference(default_gguf: Path) -> ReferenceBPE:
    import mlx.core as mx

    _, meta = mx.load(str(default_gguf), return_metadata=True)
    return ReferenceBPE(list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.merges"]), meta["tokenizer.ggml.token_type"].tolist())


@pytest.fixture(scope="module")
def hf_tokenizer(smollm_tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_tokenizer_dir))


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(hf_tokenizer, text: str) -> None:
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert hf_tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_ids_match_reference_bpe_over_gguf_merges(hf_tokenizer, reference: ReferenceBPE, text: str) -> None:
    assert hf_tokenizer.encode(text, add_special_tokens=False) == reference.encode(text)


def test_special_tokens_are_single_ids(hf_tokenizer) -> None:
    assert hf_tokenizer.encode("<|im_start|><|im_end|>", add_special_tokens=False) == [1, 2]
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.decode([1, 2], skip_special_tokens=True) == ""


def test_chat_template_comes_from_gguf(hf_tokenizer) -> None:
    text = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in text


def test_digits_are_split_one_per_token(hf_tokenizer) -> None:
    ids = hf_tokenizer.encode("12345", add_special_tokens=False)
    assert [hf_tokenizer.decode([i]) for i in ids] == list("12345")
