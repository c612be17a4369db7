"""Verify steps (the runner's side of drafting): each decoding row's last token and its drafts
in one forward pass over its KV blocks, then each row keeps the drafts its own sampler agrees
with, position by position, plus the token it samples after them. So a row emits exactly
what plain decoding would give (up to float rounding between a one-token and a
several-token pass), seeded rows included: each kept token is drawn with the key plain
decoding would use there.

:func:`verify_drafts` is the one entry: :func:`verify_lookups` serves plain rows (n-gram drafts: the arg-max, or a draw, at every
position at once); :func:`verify_forced` serves constrained rows (the grammar's mask at each
position, one walk a row: :class:`_Walk`)."""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from ..grammar.guided import fill_bitmask, only_tokens
from ..logits_processors import last_tokens, processed
from ..plan import Drafted, Verify
from ..sampled import SampledRow
from ..sampling import draw_tokens, sample_batch, sample_requests
from .forced import can_fast_forward


def verify_drafts(runner: Any, rows: Sequence[Any], verify: Verify) -> tuple[list[list[SampledRow]], dict[int, Drafted]]:
    """Run a verify step of ``rows``: what each row emits, in order, and what the drafts of
    each row that had some came to (by ``id(request)``)."""
    if verify.kind == "ngram":
        sampled, results = verify_lookups(runner, rows, verify.k)
        return sampled, {id(r): d for r, d in zip(rows, results)}
    sampled, by_index = verify_forced(runner, rows, verify.k)
    return sampled, {id(rows[i]): d for i, d in by_index.items()}


def verify_lookups(runner: Any, rows: Sequence[Any], k: int) -> tuple[list[list[SampledRow]], list[Drafted]]:
    """One forward over each row's last token and its first ``k`` drafts (n-gram drafts of
    plain rows: each position's logits through the row's bias and penalties as a plain step
    there would take them); what each row emits (its choice at every position up to the first
    rejected draft) and what its drafts came to."""
    drafts = [list(r.draft[:k]) for r in rows]
    spots = runner.logits_where_asked(list(rows), [[r.output_ids[-1], *d] for r, d in zip(rows, drafts)],
                                      [r.num_tokens - 1 for r in rows])
    firsts = [sum(len(d) + 1 for d in drafts[:i]) for i in range(len(rows))]  # each row's first position's
    logits = spots.at([(i, j) for i, d in enumerate(drafts) for j in range(len(d) + 1)])  # real positions only
    samplers = [r.state.sampler for r, d in zip(rows, drafts) for _ in range(len(d) + 1)]
    if any(s.processes for s in samplers):  # each position's bias, penalties and bans, over the tokens before it
        contexts = [lambda r=r, before=d[:j]: last_tokens(r.prompt_ids, r.output_ids, before)
                    for r, d in zip(rows, drafts) for j in range(len(d) + 1)]
        produced = [len(r.output_ids) + j for r, d in zip(rows, drafts) for j in range(len(d) + 1)]
        logits = processed(logits, samplers, contexts, produced=produced)
    greedy = mx.argmax(logits, axis=-1)
    draws = {i: _draws(r.state.sampler, logits[firsts[i] : firsts[i] + len(drafts[i]) + 1]) for i, r in enumerate(rows)
             if not r.state.sampler.greedy}
    mx.eval(greedy, [tokens for tokens, _ in draws.values()])
    flat = greedy.tolist()
    choices = [flat[firsts[i] : firsts[i] + len(d) + 1] for i, d in enumerate(drafts)]
    for i, (tokens, _) in draws.items():
        choices[i] = tokens.tolist()
    emitted: list[list[SampledRow]] = []
    results: list[Drafted] = []
    for i, (draft, chosen) in enumerate(zip(drafts, choices)):
        n = 0
        while n < len(draft) and draft[n] == chosen[n]:
            n += 1
        emitted.append([SampledRow(token=t) for t in chosen[: n + 1]])
        if i in draws:  # the key as n + 1 plain draws leave it
            rows[i].state.sampler.key = draws[i][1][n]
        results.append(Drafted(len(draft), n, n + 1))
    return emitted, results


def _draws(sampler: Any, logits: mx.array) -> tuple[mx.array, list[mx.array]]:
    """A sampled row's draw at each position of ``logits`` (``(width, vocab)``), each with
    the next key of the row's chain, lazily; and the key after each draw (the row's key is
    put back to the one after the last kept token)."""
    tokens, keys = [], []
    for j in range(logits.shape[0]):
        tokens.append(draw_tokens(logits[j : j + 1], [sampler]))
        keys.append(sampler.key)
    return mx.concatenate(tokens), keys


def verify_forced(runner: Any, rows: Sequence[Any], k: int) -> tuple[list[list[SampledRow]], dict[int, Drafted]]:
    """One forward over each constrained row's last token and its first ``k`` drafts (rows
    without, their last token only); what each row emits, in order, and what the drafts of
    each row that had some came to (by its index). Logits are computed only at the
    positions sampled from them (see :class:`_Walk`)."""
    drafts = [list(r.draft[:k]) if can_fast_forward(r) else [] for r in rows]
    spots = runner.logits_where_asked(list(rows), [[r.output_ids[-1], *d] for r, d in zip(rows, drafts)],
                                      [r.num_tokens - 1 for r in rows])
    out: list[list[SampledRow]] = [[] for _ in rows]
    results: dict[int, Drafted] = {}
    plain = [i for i, d in enumerate(drafts) if not d]
    if plain:  # sampled together, as in a plain step (each row as if alone)
        for i, row in zip(plain, sample_requests(spots.at([(i, 0) for i in plain]), [rows[i] for i in plain])):
            out[i] = [row]
    walks = {i: _Walk(rows[i], draft, spots.vocab) for i, draft in enumerate(drafts) if draft}
    try:
        while walks:  # each round: every walk on to a position its grammar leaves open, whose logits come together
            asked = [(i, walk) for i, walk in walks.items() if walk.advance()]
            if asked:  # sampled together, each as if alone
                got = sample_batch(spots.at([(i, w.j) for i, w in asked]), [w.sampler for _, w in asked],
                                   [w.history for _, w in asked], [w.left - w.j for _, w in asked])
                for (_, walk), row in zip(asked, got):
                    walk.took(row)
            for i in [i for i, walk in walks.items() if walk.done]:
                out[i] = walks.pop(i).finish()
                kept = sum(1 for got, want in zip(out[i], drafts[i]) if got.error is None and got.token == want)
                results[i] = Drafted(len(drafts[i]), kept, len(out[i]))
    finally:  # (a step that fails leaves every matcher where it was)
        for walk in walks.values():
            walk.finish()
    return out, results


class _Walk:
    """One drafting row's positions, sampled in order while each draws its draft token: the
    mask of the matcher advanced past the tokens before it, the row's PRNG key split once a
    token, as a plain step samples. Where the mask allows one token and nothing else needs
    the logits (no logits processors, no logprobs), the token is taken without them, as
    :func:`~.sampling.sample_batch` takes it; elsewhere the walk waits for the position's
    logits (:meth:`advance` says so). The matcher is left where it was (:meth:`finish`)."""

    def __init__(self, request: Any, draft: list[int], vocab: int) -> None:
        self.request, self.draft, self.vocab = request, draft, vocab
        self.sampler = request.state.sampler
        self.matcher = self.sampler.matcher
        self.left = request.params.max_tokens - len(request.output_ids)
        self.mark = self.matcher.mark()
        self.j, self.out, self.done = 0, [], False
        self.without_logits = not self.sampler.processes and not request.params.logprobs

    def advance(self) -> bool:
        """Take the positions whose one allowed token needs no logits; whether the walk now
        waits for the logits of position :attr:`j`."""
        try:
            while not self.done and self.without_logits:
                self.matcher.tokens_left = self.left - self.j
                forced = only_tokens(fill_bitmask(self.vocab, [self.matcher], self.sampler.grammar), self.vocab)
                if forced is None:
                    break
                if not self.sampler.greedy:
                    self.sampler.next_key()  # (the draw it skips would have taken it)
                self.took(SampledRow(token=forced[0]))
        except Exception as exc:  # the matcher failed: this row alone fails
            self.took(SampledRow(error=exc))
        return not self.done

    def history(self) -> list[int]:
        """The last tokens before position :attr:`j` (prompt, output, the draft's), for penalties."""
        return last_tokens(self.request.prompt_ids, self.request.output_ids, self.draft[: self.j])

    def took(self, row: SampledRow) -> None:
        """Position :attr:`j`'s token (or error): the walk goes on past it, or ends."""
        self.out.append(row)
        if row.error is not None or self.j == len(self.draft) or row.token != self.draft[self.j]:
            self.done = True
            return
        try:
            self.matcher.consume(row.token)  # the next position's mask follows it
            self.j += 1
        except Exception as exc:  # consume() refused a token the mask allowed: this row alone fails
            self.out[-1] = SampledRow(error=exc)
            self.done = True

    def finish(self) -> list[SampledRow]:
        """What the row emits; its matcher rewound to where the walk began."""
        self.matcher.rewind(self.mark)
        return self.out
