"""``bench.int8_numerics``'s measures: teacher-forced perplexity, KL divergence and top-token
agreement, and the greedy tokens kept."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from mlx_parallm_provider.bench import int8_numerics


def _uniform_logits(vocab: int):
    return lambda x: mx.zeros((1, x.shape[1], vocab))


def test_a_forward_against_itself_has_no_divergence_and_the_uniform_one_scores_the_vocabulary() -> None:
    tokens = [[1, 2, 3, 4, 5], [3, 1, 2]]
    scores = int8_numerics.teacher_forced(_uniform_logits(8), _uniform_logits(8), tokens)
    assert scores["positions"] == 6 and scores["kld"] == pytest.approx(0, abs=1e-7) and scores["same_top1"] == 1
    assert scores["perplexity"] == pytest.approx(8, rel=1e-5)  # every token at 1/8


def test_a_forward_that_prefers_another_token_diverges_and_loses_the_top_token() -> None:
    def peaked(x):  # nearly certain of token 3 everywhere
        return mx.broadcast_to(mx.array([0.0] * 3 + [9.0] + [0.0] * 4), (1, x.shape[1], 8))

    scores = int8_numerics.teacher_forced(peaked, _uniform_logits(8), [[1, 2, 3, 4]])
    assert scores["kld"] > 1 and scores["same_top1"] == 0  # (the uniform reference's arg-max: token 0)
    lse = math.log(math.exp(9) + 7)
    mean_nll = (3 * lse - 9) / 3  # targets 2, 3, 4: only 3 is the peak
    assert scores["perplexity"] == pytest.approx(math.exp(mean_nll), rel=1e-4)


def test_kept_counts_the_leading_tokens_equal_to_the_reference() -> None:
    assert int8_numerics.kept([1, 2, 3], [1, 2, 4]) == 2
    assert int8_numerics.kept([5], [1]) == 0
    assert int8_numerics.kept([1, 2], [1, 2]) == 2
    assert "int16" in int8_numerics.report({
        "model": "m", "texts": 1, "prompts": 2, "max_tokens": 4,
        "paths": {"mlx-lm": {"perplexity": 2.0}, "int16": {"perplexity": 2.0, "kld": 0.0, "same_top1": 1.0,
                                                           "identical_answers": 2, "mean_tokens_kept": 4.0}},
    })
