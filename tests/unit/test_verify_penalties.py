"""Verify steps of rows with penalties or a logit bias: each drafted position's logits go
through the row's processors over the tokens before it, drafts included, so a row keeps the
drafts, and emits the tokens, that plain steps give it (greedy and seeded rows alike). No CPU
kernel: scripts/gpu_check.sh runs these on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_parallm_provider.engine.drafting.verify import verify_lookups
from mlx_parallm_provider.engine.logits_processors import last_tokens
from mlx_parallm_provider.engine.request import SamplingParams
from mlx_parallm_provider.engine.runner import SpotLogits
from mlx_parallm_provider.engine.sampling import RowSampler, sample_batch

pytestmark = pytest.mark.gpu

VOCAB, K = 40, 5
PARAMS = [SamplingParams(repetition_penalty=1.8), SamplingParams(presence_penalty=1.0, frequency_penalty=0.8),
          SamplingParams(temperature=1.0, seed=9, presence_penalty=1.5), SamplingParams(logit_bias={3: 4.0}),
          SamplingParams()]


class Runner:
    """A verify pass's logits, fixed: ``(rows, K + 1, vocab)``."""

    def __init__(self, logits: mx.array) -> None:
        self.logits = logits

    def logits_where_asked(self, rows, pieces, starts) -> SpotLogits:
        assert [len(p) for p in pieces] == [len(r.draft[:K]) + 1 for r in rows]
        return SpotLogits(self.logits, None, VOCAB)


def _row(params: SamplingParams, prompt: list[int], output: list[int]) -> SimpleNamespace:
    return SimpleNamespace(prompt_ids=prompt, output_ids=output, draft=[], num_tokens=len(prompt) + len(output),
                           state=SimpleNamespace(sampler=RowSampler(params)), params=params)


def _plain_steps(params: SamplingParams, prompt: list[int], output: list[int], logits: mx.array) -> list[int]:
    """The row's token at each position, sampled one plain step after another."""
    sampler, chosen = RowSampler(params), []
    for j in range(logits.shape[0]):
        [row] = sample_batch(logits[j : j + 1], [sampler], [lambda: last_tokens(prompt, output, chosen)])
        chosen.append(row.token)
    return chosen


@pytest.mark.parametrize("wrong_at", [None, 2])
def test_drafts_are_kept_and_tokens_emitted_as_plain_steps_give_them(wrong_at) -> None:
    logits = mx.random.normal((len(PARAMS), K + 1, VOCAB), key=mx.random.key(4)) * 1.5
    prompts = [[int(t) for t in mx.random.randint(0, VOCAB, (12,), key=mx.random.key(10 + i)).tolist()] for i in range(len(PARAMS))]
    outputs = [p[-3:] for p in prompts]
    rows = [_row(q, p, list(o)) for q, p, o in zip(PARAMS, prompts, outputs)]
    expected = [_plain_steps(q, p, o, logits[i]) for i, (q, p, o) in enumerate(zip(PARAMS, prompts, outputs))]
    unpenalised = mx.argmax(logits, axis=-1).tolist()
    assert any(expected[i] != unpenalised[i] for i in (0, 1, 3))  # (the processors change the greedy rows' tokens)
    for row, want in zip(rows, expected):
        row.draft = list(want[:K])
        if wrong_at is not None:
            row.draft[wrong_at] = (row.draft[wrong_at] + 1) % VOCAB
    emitted, results = verify_lookups(Runner(logits), rows, K)
    kept = K if wrong_at is None else wrong_at
    assert [[s.token for s in e] for e in emitted] == [want[: kept + 1] for want in expected]
    assert [(r.drafted, r.accepted) for r in results] == [(K, kept)] * len(rows)
    # a seeded row's key is where kept + 1 plain draws leave it: its next draw is theirs
    again = RowSampler(PARAMS[2])
    for _ in range(kept + 1):
        again.next_key()
    assert mx.array_equal(rows[2].state.sampler.key, again.key).item()
