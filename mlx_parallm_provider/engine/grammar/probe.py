"""A grammar tried against the model's tokenizer before its request is admitted.

Some grammars are valid on their own and fail only once a matcher runs them: a special
token the model's tokenizer lacks fails when the matcher is built; ``{"$ref": "#"}`` at
the first mask; a required ``$ref`` that recurses without end, 30,000 Lark alternatives
or 5,000 optional properties after the first token (llguidance's parser limits). Each
distinct grammar is built once per model (:class:`~.guided.GrammarTokenizer`), and
:func:`probe` walks a copy of it a few tokens (what the grammar forces, else the lowest
allowed token id), so these fail at submit as a 400. What only some outputs reach (an
ambiguous grammar whose parser gives up after a dozen tokens) still fails mid-generation,
for that request alone, with the same one-line cause (:func:`grammar_error`). No MLX here.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Collection, Sequence

import numpy as np

from ...errors import InvalidParameterError
from .constraint import import_llguidance

if TYPE_CHECKING:
    from .guided import GrammarTokenizer

#: Choices of a token :func:`probe` makes after the first mask.
PROBE_TOKENS = 4
#: Tokens a grammar forces that :func:`probe` follows at once, at most, per choice.
FORCED_TOKENS = 64
#: Allowed tokens :func:`probe` tries, lowest id first, for one that llguidance validates.
CANDIDATES = 16

#: What a user can do about llguidance's errors, by a piece of their text.
_HINTS = (
    ("ff_tokens", "no output of finite length matches: does a required $ref or rule recurse with no way out?"),
    ("Current row has", "too many alternatives at one point (properties, rules or literals): "
                        "write a long list of values as an enum or a regex"),
    ("Too many items", "the grammar is too ambiguous for the parser"),
    ("lexer", "a regex of the grammar is too complex"),
    ("forced bytes", "the model's tokenizer cannot write a character the grammar requires here (a rare Unicode character?)"),
    ("NoExtension", "nothing the grammar allows can follow this point (a part of it no output satisfies)"),
)


def describe(error: str) -> str:
    """llguidance's error in one line: without the parser state or grammar it may append,
    the list of the tokenizer's special tokens after an unknown one, or its advice on
    rewriting (a hint of ours instead, where one fits)."""
    lines = [line.strip() for line in (error or "").splitlines()]
    first = next((line for line in lines if line and line != "<non-verbose/>"), "unknown error")
    parts = [part for part in first.split("; ") if not part.startswith(("try ", "consider ", "following special tokens"))]
    cause = "; ".join(parts)[:300]
    hint = next((h for key, h in _HINTS if key.lower() in cause.lower()), "")
    return f"{cause}; {hint}" if hint else cause


def grammar_error(error: str, consumed: int) -> InvalidParameterError:
    """The request's error when its matcher failed (``error``: llguidance's text) after
    ``consumed`` tokens of output."""
    return InvalidParameterError("constraint", failure(error, consumed))


def failure(error: str, consumed: int, built: bool = True) -> str:
    """What :func:`grammar_error` says (``built``: False when building the matcher failed)."""
    cause = describe(error)
    if not built:
        return f"cannot be used with this model's tokenizer ({cause})"
    if consumed == 0:
        return f"no output can satisfy it ({cause})"
    return f"the grammar fails after {consumed} token{'s' if consumed != 1 else ''} of output ({cause})"


def build_checked(tokenizer: Any, grammar: str, eos: Collection[int]) -> tuple[Any, str]:
    """A matcher of ``grammar`` on ``tokenizer`` (an ``LLTokenizer``) and what :func:`probe`
    found wrong with it ("" when nothing; the matcher is then None). Call on a compiler
    thread (:func:`~.build_threads.run_compiler`): llguidance recurses on the caller's stack."""
    llg = import_llguidance()
    matcher = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=llg.LLParserLimits(verbose_errors=False))
    error = probe(matcher.deep_copy(), tokenizer.vocab_size, eos)
    return (None, error) if error else (matcher, "")


def probe(matcher: Any, vocab_size: int, eos: Collection[int], steps: int = PROBE_TOKENS) -> str:
    """Walk ``matcher`` (consumed: pass a copy) ``steps`` choices: at each, the tokens its
    grammar forces (up to :data:`FORCED_TOKENS`), else the lowest id its mask allows other
    than EOS; what failed (:func:`failure`), or "". Only tokens llguidance validates are
    taken where any is (its mask may allow one that it then refuses), so a failure is
    what any output along that path meets."""
    if matcher.is_error():
        return failure(matcher.get_error(), 0, built=False)
    words = (vocab_size + 31) // 32
    bitmask = np.zeros(words, dtype=np.int32)
    consumed = 0
    for step in range(steps + 1):
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, words * 4)
        if matcher.is_error():
            return failure(matcher.get_error(), consumed)
        if step == steps or matcher.is_stopped():
            return ""
        forced = [int(t) for t in matcher.compute_ff_tokens()[:FORCED_TOKENS]]
        tokens = forced[: matcher.validate_tokens(forced)] if forced and not matcher.is_error() else []
        if not tokens and not matcher.is_error():
            allowed = [int(t) for t in np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:vocab_size])
                       if int(t) not in eos]
            if not allowed:  # only EOS: the grammar is complete
                return ""
            tokens = [next((t for t in allowed[:CANDIDATES] if matcher.validate_tokens([t]) == 1), allowed[0])]
        for token in tokens:
            if matcher.is_error():
                break
            matcher.consume_token(token)
            consumed += 1
        if matcher.is_error():
            return failure(matcher.get_error(), consumed)
    return ""


async def build_off_loop(tokenizer: "GrammarTokenizer", params: Sequence[Any]) -> None:
    """Build and probe the grammars of ``params``' constraints (SamplingParams) that
    ``tokenizer`` has not built yet, on a thread: a large one takes
    seconds, which would stall every stream of an async caller's loop. Errors stay cached
    for the submit, which raises them."""
    grammars = {p.constraint.grammar() for p in params if getattr(p, "constraint", None) is not None}
    if grammars and not all(map(tokenizer.checked, grammars)):
        await asyncio.to_thread(_build_all, tokenizer, grammars)


def _build_all(tokenizer: "GrammarTokenizer", grammars: set[str]) -> None:
    for grammar in grammars:
        try:
            tokenizer.check(grammar)
        except InvalidParameterError:
            pass  # raised again, from the cache, when the request is submitted
