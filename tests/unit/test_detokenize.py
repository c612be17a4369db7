"""Tests for streaming detokenization and stop-string matching (no model needed)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from mlx_parallm_provider.engine.detokenize import IncrementalDetokenizer, StopStringMatcher, TextStream, direct_decoder

FFFD = "\ufffd"

TEXTS = {
    "ascii": "Hello world, this is plain ASCII text.",
    "accents": "Café naïve résumé: Ünïcödé ñ ø å.",
    "emoji": "I like 🍕 and 🎉🎉! 👍🏽 👨\u200d👩\u200d👧",
    "cjk": "日本語のテキスト。中文字符串。",
    "mixed": "Hello 世界 🍕 café\nnew line 中文 ok",
}


class ByteTokenizer:
    """Byte-level fake: every single byte is a token, plus multi-byte tokens, some of
    which split UTF-8 characters (the tail of one character and the head of the next)."""

    MULTI = [
        b"Hello", b" world", b"caf", "é".encode(), b"\xf0\x9f", b"\x8d\x95",  # 🍕 split 2+2
        b"\xe4\xb8", b"\xad\xe6", b"\x96\x87",  # 中文 split 2 + (1+1) + 2
        b"\xe7", b" ",
    ]

    def __init__(self) -> None:
        self.vocab: list[bytes] = [bytes([b]) for b in range(256)] + self.MULTI
        self.calls: list[tuple[int, dict[str, Any]]] = []  # (len(ids), kwargs) per decode

    def encode(self, text: str) -> list[int]:
        data, ids, i = text.encode(), [], 0
        by_len = sorted(range(len(self.vocab)), key=lambda t: -len(self.vocab[t]))
        while i < len(data):
            tok = next(t for t in by_len if data.startswith(self.vocab[t], i))
            ids.append(tok)
            i += len(self.vocab[tok])
        return ids

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.calls.append((len(ids), kwargs))
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")


class SpaceTokenizer:
    """Sentencepiece-like fake: words carry a leading "▁" that decode turns into a space,
    except at the very start of the decoded sequence."""

    def __init__(self, words: list[str]) -> None:
        self.vocab = words

    def decode(self, ids: list[int]) -> str:
        text = "".join(self.vocab[i] for i in ids).replace("\u2581", " ")
        return text[1:] if text.startswith(" ") else text


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    """A real byte-level BPE (Hugging Face ``tokenizers``) trained in memory on a tiny
    corpus, so emoji and CJK stay split across several tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(list(TEXTS.values()) * 3, vocab_size=300, min_frequency=2,
                            show_progress=False)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, clean_up_tokenization_spaces=False
    )


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = [detok.add_token(i) for i in ids]
    return pieces + [detok.flush()]


# -- IncrementalDetokenizer -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(TEXTS))
def test_byte_tokenizer_round_trip_without_partial_characters(name: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXTS[name])
    pieces = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(pieces) == tok.decode(ids) == TEXTS[name]
    assert not any(FFFD in p for p in pieces)


@pytest.mark.parametrize("name", list(TEXTS))
def test_hf_byte_level_bpe_round_trip(hf_tokenizer: Any, name: str) -> None:
    ids = hf_tokenizer.encode(TEXTS[name])
    pieces = stream(IncrementalDetokenizer(hf_tokenizer), ids)
    assert "".join(pieces) == hf_tokenizer.decode(ids) == TEXTS[name]
    assert not any(FFFD in p for p in pieces)


def test_hf_tokenizer_really_splits_characters(hf_tokenizer: Any) -> None:
    # Guards the two tests above: the non-ASCII texts must contain tokens that are only
    # part of a character, or they would not exercise the hold-back logic.
    for name in ("emoji", "cjk"):
        ids = hf_tokenizer.encode(TEXTS[name])
        assert any(FFFD in hf_tokenizer.decode([i]) for i in ids), name


def test_mlx_lm_tokenizer_wrapper(hf_tokenizer: Any) -> None:
    tokenizer_utils = pytest.importorskip("mlx_lm.tokenizer_utils")
    wrapper = tokenizer_utils.TokenizerWrapper(hf_tokenizer)
    ids = hf_tokenizer.encode(TEXTS["mixed"])
    assert "".join(stream(IncrementalDetokenizer(wrapper), ids)) == TEXTS["mixed"]


def test_the_direct_decoder_decodes_as_the_tokenizer_does(smollm_tokenizer_dir: Path) -> None:
    tokenizer_utils = pytest.importorskip("mlx_lm.tokenizer_utils")
    wrapper = tokenizer_utils.load(smollm_tokenizer_dir)
    for tokenizer in (wrapper, wrapper._tokenizer):
        direct = direct_decoder(tokenizer)
        assert direct is not tokenizer  # (its Rust tokenizer, called directly)
        rng = random.Random(0)
        special = sorted(wrapper._tokenizer.all_special_ids)
        for _ in range(300):
            ids = [rng.choice(special) if rng.random() < 0.2 else rng.randrange(wrapper.vocab_size) for _ in range(rng.randint(1, 6))]
            for skip in (False, True):
                assert direct.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip), ids
        ids = tokenizer.encode(TEXTS["mixed"])
        assert "".join(stream(IncrementalDetokenizer(direct), ids)) == "".join(stream(IncrementalDetokenizer(tokenizer), ids))


def test_the_direct_decoder_is_the_tokenizer_where_its_decode_does_more(hf_tokenizer: Any) -> None:
    transformers = pytest.importorskip("transformers")
    cleaning = transformers.PreTrainedTokenizerFast(tokenizer_object=hf_tokenizer.backend_tokenizer, clean_up_tokenization_spaces=True)

    class OwnDecode(transformers.PreTrainedTokenizerFast):
        def decode(self, *args: Any, **kwargs: Any) -> str:
            return super().decode(*args, **kwargs).upper()

    own = OwnDecode(tokenizer_object=hf_tokenizer.backend_tokenizer, clean_up_tokenization_spaces=False)
    byte = ByteTokenizer()
    assert direct_decoder(hf_tokenizer) is not hf_tokenizer
    assert direct_decoder(cleaning) is cleaning and direct_decoder(own) is own and direct_decoder(byte) is byte


def test_split_character_is_held_until_complete() -> None:
    tok = ByteTokenizer()
    ids = [0xE4, 0xB8, 0xAD, ord("!")]  # 中 one byte per token, then "!"
    det = IncrementalDetokenizer(tok)
    assert [det.add_token(i) for i in ids] == ["", "", "中", "!"]
    assert det.flush() == ""


def test_token_with_tail_and_head_of_two_characters() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("中文")
    assert [tok.vocab[i] for i in ids] == [b"\xe4\xb8", b"\xad\xe6", b"\x96\x87"]
    det = IncrementalDetokenizer(tok)
    assert [det.add_token(i) for i in ids] == ["", "", "中文"]


def test_flush_releases_incomplete_character_as_replacement() -> None:
    det = IncrementalDetokenizer(ByteTokenizer())
    assert det.add_token(ord("a")) == "a"
    assert det.add_token(0xE4) == ""
    assert det.add_token(0xB8) == ""
    assert det.has_pending
    assert det.flush() == FFFD
    assert not det.has_pending
    assert det.flush() == ""


def test_invalid_bytes_do_not_stall_the_stream() -> None:
    tok = ByteTokenizer()
    ids = [0x80] * 20 + tok.encode("ok")  # stray continuation bytes: never valid
    det = IncrementalDetokenizer(tok, max_pending_tokens=8)
    pieces = [det.add_token(i) for i in ids]
    assert "".join(pieces[:8]) == FFFD * 8  # released after max_pending_tokens
    assert "".join(pieces) + det.flush() == tok.decode(ids) == FFFD * 20 + "ok"


def test_decode_window_stays_bounded() -> None:
    tok = ByteTokenizer()
    ids = tok.encode(TEXTS["mixed"] * 40)
    det = IncrementalDetokenizer(tok)
    out = "".join(stream(det, ids))
    assert out == TEXTS["mixed"] * 40
    assert max(n for n, _ in tok.calls) <= 8  # not len(ids): no re-decoding of the output


def test_prompt_context_keeps_context_dependent_spacing() -> None:
    tok = SpaceTokenizer(["\u2581Hi", "\u2581there", "!", "\u2581you"])
    ids = [1, 2, 3]
    # Without context the first token decodes like the start of a text ...
    assert "".join(stream(IncrementalDetokenizer(tok), ids)) == tok.decode(ids) == "there! you"
    # ... with the prompt as context it keeps its space, and the prompt is not emitted.
    det = IncrementalDetokenizer(tok, prompt_ids=[0, 0, 0])
    assert [det.add_token(i) for i in ids] == [" there", "!", " you"]


def test_skip_special_tokens_is_forwarded_only_when_requested() -> None:
    tok = ByteTokenizer()
    IncrementalDetokenizer(tok).add_token(ord("a"))
    assert all(kwargs == {} for _, kwargs in tok.calls)
    tok.calls.clear()
    IncrementalDetokenizer(tok, skip_special_tokens=True).add_token(ord("a"))
    assert tok.calls and all(kw == {"skip_special_tokens": True} for _, kw in tok.calls)


# -- StopStringMatcher ----------------------------------------------------------------------


def feed_all(matcher: StopStringMatcher, chunks: list[str]) -> tuple[list[str], bool]:
    out: list[str] = []
    for chunk in chunks:
        text, stopped = matcher.feed(chunk)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_no_stop_strings_pass_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.pending == ""
    assert m.flush() == ""


def test_stop_string_spanning_tokens_never_leaks() -> None:
    m = StopStringMatcher(["<|end|>"])
    out, stopped = feed_all(m, ["Hel", "lo<", "|", "en", "d|", ">wor", "ld"])
    assert stopped and m.matched == "<|end|>"
    assert out == ["Hel", "lo", "", "", "", ""]
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_an_included_stop_string_ends_the_text_however_it_is_chunked() -> None:
    text = "say <|en <|end|> more"
    for chunks in ([text], list(text), ["say <|en <|e", "nd|", "> more"]):
        m = StopStringMatcher(["<|end|>", "zzz"], include=True)
        out, stopped = feed_all(m, chunks)
        assert stopped and m.matched == "<|end|>" and "".join(out) == "say <|en <|end|>"


def test_partial_match_that_diverges_is_released() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("go ST") == ("go ", False)
    assert m.pending == "ST"
    assert m.feed("ARS") == ("STAR", False)  # "S" could still start "STOP"
    assert m.feed(" ok") == ("S ok", False)
    assert m.flush() == ""


def test_overlapping_partial_match() -> None:
    out, stopped = feed_all(StopStringMatcher(["aab"]), list("xaaab"))
    assert stopped and "".join(out) == "xa"


def test_stop_strings_that_are_prefixes_of_each_other() -> None:
    # The shorter one completes first, however the text is chunked.
    for chunks in (["it ENDING"], list("it ENDING"), ["it EN", "DING"]):
        m = StopStringMatcher(["ENDING", "END"])
        out, stopped = feed_all(m, chunks)
        assert stopped and "".join(out) == "it " and m.matched == "END"
    # Stop strings sharing a prefix: held while either may follow, released when neither can.
    m = StopStringMatcher(["<|im_end|>", "<|im_start|>"])
    assert m.feed("a<|im_") == ("a", False)
    assert m.feed("s") == ("", False)
    assert m.feed("ay") == ("<|im_say", False)
    assert m.feed("<|im_en") == ("", False)
    assert m.feed("d|>tail") == ("", True) and m.matched == "<|im_end|>"


def test_stop_match_is_independent_of_chunking() -> None:
    # "b" ends before "abc" does, so it wins whether "abc" arrives at once or not.
    for chunks in (["abc"], list("abc")):
        m = StopStringMatcher(["abc", "b"])
        out, stopped = feed_all(m, chunks)
        assert stopped and "".join(out) == "a" and m.matched == "b"


def test_flush_releases_held_text() -> None:
    m = StopStringMatcher(["###"])
    assert m.feed("answer ##") == ("answer ", False)
    assert m.flush() == "##"


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text before the stop string that ends first (ties: the longest)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            return text[: end - max(map(len, hits))], True
    return text, False


def test_random_streams_match_reference() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abc", k=rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, 4)))
        chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        out, stopped = feed_all(StopStringMatcher(stops), chunks)
        expected, expect_stop = reference_cut(text, stops)
        assert ("".join(out), stopped) == (expected, expect_stop), (stops, chunks)


# -- TextStream -----------------------------------------------------------------------------


def test_text_stream_stops_on_string_made_of_split_characters() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("I like 🍕 a lot")
    ts = TextStream(tok, stop=["🍕"])
    pieces: list[str] = []
    for i in ids:
        piece, stopped = ts.add_token(i)
        pieces.append(piece)
        if stopped:
            break
    assert stopped and ts.stopped and ts.matched_stop == "🍕"
    assert "".join(pieces) == ts.text == "I like "
    assert ts.add_token(ord("x")) == ("", True)
    assert ts.finish() == ""


def test_text_stream_finish_releases_held_text_and_partial_character() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("done ##") + [0xE4]
    ts = TextStream(tok, stop=["###"])
    streamed = "".join(ts.add_token(i)[0] for i in ids)
    assert streamed == "done "
    assert ts.finish() == "##" + FFFD
    assert ts.text == "done ##" + FFFD and not ts.stopped


def test_text_stream_emits_text_before_stop_in_same_token() -> None:
    tok = SpaceTokenizer(["\u2581end", "X"])
    ts = TextStream(tok, stop=["end"])
    assert ts.add_token(1) == ("X", False)
    assert ts.add_token(0) == (" ", True)  # the token renders " end"
    assert ts.text == "X " and ts.finish() == ""
