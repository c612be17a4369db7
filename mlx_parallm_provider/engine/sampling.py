"""Per-request sampling inside one batch, built from mlx-lm's samplers and logits processors.

Every row of a batch keeps its own settings. Greedy rows share one batched ``argmax``;
each sampling row draws with its own PRNG key, derived from its ``seed`` (or a random one),
and split once per token. So a seeded request samples the same tokens whatever else is
in the batch: no global RNG state is shared between rows. The sampling rows' keys are split
and their draws made by one op each for the whole batch (``mx.vmap``), which gives each row
what it would draw alone. The engine's backend may normalise, filter and draw them, and rank
their top logprobs, by ops of its own (:meth:`.MLXOps.log_softmax`, :meth:`.MLXOps.filter_rows`,
:meth:`.MLXOps.gumbel_draw`, :meth:`.MLXOps.top_tokens`: the CPU kernels', many times faster,
give the logprobs MLX's ops give and keep and draw the tokens mlx-lm's filters and MLX's draw
do, but where rounding decides a draw's tie).
"""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from .grammar.guided import GrammarTokenizer, RowMatcher, apply_bitmask, grammar_bitmask, only_tokens
from .logits_processors import History, Penalties, last_tokens, output_lengths, processed
from .request import SamplingParams
from .sampled import SampledRow
from .token_bans import TokenBans, held_open

if TYPE_CHECKING:
    from ..models.backends import MLXOps

class RowSampler:
    """Sampling state of one request: its logits processors, filters and PRNG key.

    ``ops``: the engine's model's backend, whose batched log-softmax, filters and draw
    (:meth:`.MLXOps.filter_rows`, :meth:`.MLXOps.gumbel_draw`) take the rows where they can;
    None: MLX's ops and mlx-lm's filters (:func:`filter_rows`). ``bans``: the tokens it may
    not sample (:class:`.TokenBans`: ``min_tokens``, ``allowed_token_ids``, ``bad_words``)."""

    def __init__(self, params: SamplingParams, grammar: Optional[GrammarTokenizer] = None, ops: Optional["MLXOps"] = None,
                 bans: Optional[TokenBans] = None) -> None:
        self.params = params
        self.ops = ops
        self.grammar = grammar
        self.matcher = RowMatcher(params.constraint, grammar) if params.constraint is not None and grammar else None
        penalties = Penalties(params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
        self.penalties = penalties if penalties != Penalties() else None
        self.bias = bool(params.logit_bias)
        self.bans = bans
        self.greedy = params.temperature == 0.0
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.key = mx.random.key(seed)

    @property
    def processes(self) -> bool:
        """Whether the row's logits go through a logit bias, penalties or bans (:func:`processed`:
        mlx-lm's logits processors' arithmetic, for all of a step's rows at once)."""
        return self.bias or self.penalties is not None or self.bans is not None

    @property
    def filters(self) -> bool:
        """Whether the row filters its tokens (top-p, min-p or top-k set)."""
        p = self.params
        return 0.0 < p.top_p < 1.0 or p.min_p > 0.0 or p.top_k > 0

    def check_width(self, vocab: int) -> None:
        """Refuse a logit bias outside the logits: MLX does not bounds-check that index."""
        bias = self.params.logit_bias
        if bias and max(bias) >= vocab:
            raise ValueError(f"logit_bias token id {max(bias)} is outside the model's {vocab} logits")

    def next_key(self) -> mx.array:
        """The key of this row's next draw (its chain split once, as every draw splits it)."""
        self.key, key = mx.random.split(self.key)
        return key

    def scale(self, values: mx.array) -> mx.array:
        """``values`` divided by this row's temperature."""
        return values * (1.0 / self.params.temperature)


def sample_batch(
    logits: mx.array,
    samplers: Sequence[RowSampler],
    contexts: Sequence[Optional[History]],
    tokens_left: Optional[Sequence[int]] = None,
) -> list[SampledRow]:
    """Pick the next token of every row of ``logits`` (shape ``[B, vocab]``).

    ``contexts[i]`` returns row i's tokens so far (prompt + output, or only their last
    :data:`HISTORY_TOKENS`) for its penalties and bad words; it is only called for rows that
    have them. ``tokens_left[i]``: row i's budget including this token (a constrained JSON row
    is steered to close near its end; a row's ``min_tokens`` counts its output from it). A row
    whose processors, filters or draw fail gets a :class:`SampledRow` with ``error`` set;
    every other row is sampled as if it were alone, so one bad row never costs its
    neighbours their token.
    """
    for i, sampler in enumerate(samplers):
        if sampler.matcher is not None and tokens_left is not None:
            sampler.matcher.tokens_left = tokens_left[i]
    keys = [s.key for s in samplers]
    produced = [s.params.max_tokens - left for s, left in zip(samplers, tokens_left)] if tokens_left is not None else None
    try:
        return _sample_rows(logits, samplers, contexts, produced)
    except Exception:  # some row broke the batched evaluation: find it by sampling row by row
        for sampler, key in zip(samplers, keys):
            sampler.key = key  # rewind, so a seeded row draws what it would have drawn alone
        out = []
        for i in range(logits.shape[0]):
            try:
                out.append(_sample_rows(logits[i : i + 1], samplers[i : i + 1], contexts[i : i + 1],
                                        produced[i : i + 1] if produced is not None else None)[0])
            except Exception as exc:
                out.append(SampledRow(error=exc))
        return out


def _sample_rows(
    logits: mx.array,
    samplers: Sequence[RowSampler],
    contexts: Sequence[Optional[History]],
    produced: Optional[Sequence[int]],
) -> list[SampledRow]:
    logits = processed(logits, samplers, contexts, produced=produced, hold=False)
    wants = [i for i, s in enumerate(samplers) if s.params.logprobs]
    if any(s.matcher is not None for s in samplers):
        grammar = next(s.grammar for s in samplers if s.matcher is not None)
        matchers = [s.matcher for s in samplers]
        bitmask = grammar_bitmask(logits, matchers, grammar)
        plain = not wants and all(m is not None for m in matchers) and not any(s.processes for s in samplers)
        forced = only_tokens(bitmask, logits.shape[-1]) if plain else None
        if forced is not None:  # each row's one allowed token: what its draw gives, without the draw's ops
            mx.eval(logits)  # (the step's forward still runs to its end here, as a drawn token waits for it)
            for sampler in samplers:
                if not sampler.greedy:
                    sampler.next_key()  # (the draw it skips would have taken it)
            return [SampledRow(token=t) for t in forced]
        logits = apply_bitmask(logits, bitmask)
    if any(s.bans for s in samplers):  # (after the grammar's mask: where it allows only a stop token, the row ends)
        logits = held_open(logits, [s.bans for s in samplers], output_lengths(produced))
    if not wants:
        tokens = draw_tokens(logits, samplers)
        mx.eval(tokens)
        return [SampledRow(token=t) for t in tokens.tolist()]
    logprobs = log_softmax(logits, next((s.ops for s in samplers), None))
    tokens = _pick(logits, samplers, logprobs)

    wanted = mx.array(wants)
    chosen = mx.take_along_axis(logprobs[wanted], tokens[wanted][:, None], axis=-1)
    ranked = [i for i in wants if samplers[i].params.top_logprobs]
    best = _best_tokens(logprobs, ranked, samplers)
    mx.eval(tokens, chosen, best)
    out = [SampledRow(token=t) for t in tokens.tolist()]
    for i, (logprob,) in zip(wants, chosen.tolist()):
        out[i].logprob = logprob
    if best is not None:
        for i, ids, values in zip(ranked, *(a.tolist() for a in best)):
            out[i].top = sorted(zip(ids, values), key=lambda p: -p[1])[: samplers[i].params.top_logprobs]
    return out


def _best_tokens(logprobs: mx.array, rows: list[int], samplers: Sequence[RowSampler]) -> Optional[tuple[mx.array, mx.array]]:
    """The ``rows``' most likely tokens, as many for each as the most any of them asks
    (``top_logprobs``), and their logprobs (:func:`top_tokens`)."""
    if not rows:
        return None
    return top_tokens(logprobs[mx.array(rows)], max(samplers[i].params.top_logprobs for i in rows), samplers[rows[0]].ops)


def top_tokens(logprobs: mx.array, k: int, ops: Optional["MLXOps"]) -> tuple[mx.array, mx.array]:
    """Each row's ``k`` most likely tokens and their logprobs, each ``(rows, k)``: by the
    backend's op where it takes them (the most likely first), else by MLX's ``argpartition``
    (in no order)."""
    ids = ops.top_tokens(logprobs, k) if ops is not None else None
    if ids is None:
        ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    return ids, mx.take_along_axis(logprobs, ids, axis=-1)


def draw_tokens(logits: mx.array, samplers: Sequence[RowSampler]) -> mx.array:
    """Each row's next token as a lazy ``(B,)`` array, for rows with no grammar or logprobs
    (``logits`` already through their bias and penalties, :func:`processed`): the arg-max for
    greedy rows, a draw with the row's next key for the others (:func:`_pick`)."""
    if all(s.greedy for s in samplers):
        return mx.argmax(logits, axis=-1)
    return _pick(logits, samplers)


_split_each = mx.vmap(mx.random.split)
_draw_each = mx.vmap(lambda row, key: mx.argmax(row + mx.random.gumbel(row.shape, key=key)))
"""Each row's draw (the Gumbel-max trick) with its own key: row by row or many at once, a row
draws the same token, whatever else is drawn beside it."""


def _draw(rows: mx.array, keys: mx.array, ops: Optional["MLXOps"]) -> mx.array:
    """The rows' draws (:data:`_draw_each`'s tokens) by the backend's op where it takes them."""
    drawn = ops.gumbel_draw(rows, keys) if ops is not None else None
    return drawn if drawn is not None else _draw_each(rows, keys)


def log_softmax(rows: mx.array, ops: Optional["MLXOps"]) -> mx.array:
    """``rows - logsumexp(rows)`` row by row, by the backend's op where it takes them."""
    got = ops.log_softmax(rows) if ops is not None else None
    return got if got is not None else rows - mx.logsumexp(rows, axis=-1, keepdims=True)


def _filtered(logprobs: mx.array, samplers: list[RowSampler], ops: Optional["MLXOps"]) -> mx.array:
    """Rows of logprobs ``(n, vocab)`` through their filters: by the backend's op where it
    takes them, else :func:`filter_rows`."""
    params = [s.params for s in samplers]
    if ops is not None:
        got = ops.filter_rows(logprobs, [p.top_p for p in params], [p.min_p for p in params], [p.top_k for p in params])
        if got is not None:
            return got
    return filter_rows(logprobs, params)


def filter_rows(logprobs: mx.array, params: Sequence[SamplingParams]) -> mx.array:
    """mlx-lm's ``apply_top_p``, ``apply_min_p`` and ``apply_top_k``, in that order, over rows
    of logprobs ``(n, vocab)`` with their own settings, as one batch of ops (on a GPU a few
    launches, not a few a row): each filter over every row, its setting a column (top-k: one
    call for each ``k``), where a row does not set it, the row kept as it was. Each row's
    values are those mlx-lm's functions give it alone."""
    def merged(on: list[bool], filtered: mx.array, before: mx.array) -> mx.array:
        return filtered if all(on) else mx.where(mx.array(on)[:, None], filtered, before)

    def column(values: list[float]) -> mx.array:
        return mx.array(values, dtype=mx.float32)[:, None]

    out = logprobs
    on = [0.0 < p.top_p < 1.0 for p in params]
    if any(on):
        out = merged(on, apply_top_p(out, column([p.top_p if o else 1.0 for p, o in zip(params, on)])), out)
    on = [p.min_p > 0.0 for p in params]
    if any(on):  # (apply_min_p's arithmetic, its log(min_p) a column)
        floor = mx.max(out, axis=-1, keepdims=True) + column([math.log(p.min_p) if o else 0.0 for p, o in zip(params, on)]).astype(out.dtype)
        out = merged(on, mx.where(out < floor, -float("inf"), out), out)
    for k in sorted({p.top_k for p in params if 0 < p.top_k < out.shape[-1]}):  # (top_k >= vocabulary keeps every token)
        out = merged([p.top_k == k for p in params], apply_top_k(out, k), out)
    return out


def _pick(logits: mx.array, samplers: Sequence[RowSampler], logprobs: Optional[mx.array] = None) -> mx.array:
    """Each row's token: the arg-max, or a draw with its next key. The sampling rows draw
    together (their keys split by one op, their draws by another: on a GPU a few launches a
    step, not several a row), each with its own key. A row that filters (top-p, min-p,
    top-k) draws from its normalised ``logprobs`` (where not given, computed here for the rows
    that filter alone); the others from the logits themselves, the same draw (the Gumbel-max
    arg-max does not move when a row's values shift alike) without a normalisation pass over
    the vocabulary, whether or not a row beside them filters or wants logprobs."""
    greedy = mx.argmax(logits, axis=-1)
    drawing = [i for i, s in enumerate(samplers) if not s.greedy]
    if not drawing:
        return greedy
    ops = samplers[drawing[0]].ops
    filtering = [samplers[i].filters for i in drawing]  # (every row's asked: a row's fault surfaces in any batch)
    which = [i for i, f in zip(drawing, filtering) if f]
    order = which + [i for i, f in zip(drawing, filtering) if not f]  # (the filtering rows first, in one block)
    pairs = _split_each(mx.stack([samplers[i].key for i in order]))  # (n, 2, 2): each row's next key, its draw's key
    parts = []
    if which:
        part = log_softmax(logits[mx.array(which)], ops) if logprobs is None else logprobs[mx.array(which)]
        parts.append(_filtered(part, [samplers[i] for i in which], ops))
    if len(order) > len(which):
        parts.append(logits[mx.array(order[len(which) :])])
    rows = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    scales = mx.array([1.0 / samplers[i].params.temperature for i in order], dtype=mx.float32)
    drawn = _draw(rows * scales[:, None].astype(rows.dtype), pairs[:, 1], ops)
    for n, i in enumerate(order):
        samplers[i].key = pairs[n, 0]
    if order == list(range(len(samplers))):
        return drawn.astype(greedy.dtype)
    where = mx.array(order, dtype=mx.int32)
    return greedy.at[where].add(drawn.astype(greedy.dtype) - greedy[where])  # (the drawn tokens in their rows' places)


def sample_requests(logits: mx.array, requests: Sequence[Any]) -> list[SampledRow]:
    """:func:`sample_batch` for decoding requests (``logits`` ``(B, vocab)``, one row each):
    their samplers, their tokens so far as the processors' context, their budgets left."""
    return sample_batch(logits, [r.state.sampler for r in requests], _histories(requests), [r.params.max_tokens - len(r.output_ids) for r in requests])


def draw_requests(logits: mx.array, requests: Sequence[Any], pending: Optional[mx.array] = None) -> mx.array:
    """Each decoding request's next token as a lazy ``(B,)`` array, for rows whose token needs
    no work on the host (:func:`~.sampled.plain_row`): their logits through their processors
    (:func:`processed`; ``pending``: the tokens of the step before, not yet on the host), then
    :func:`draw_tokens`."""
    samplers = [r.state.sampler for r in requests]
    produced = [len(r.output_ids) + (pending is not None) for r in requests]
    return draw_tokens(processed(logits, samplers, _histories(requests), pending, produced), samplers)


def _histories(requests: Sequence[Any]) -> list[History]:
    """Each decoding request's tokens so far, for its penalties (:func:`last_tokens`)."""
    return [lambda r=r: last_tokens(r.prompt_ids, r.output_ids) for r in requests]
