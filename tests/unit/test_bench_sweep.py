"""``--sweep`` parsing and choosing the best setting for an SLO."""

from __future__ import annotations

import pytest

from mlx_parallm_provider.bench import sweep


def test_settings_are_every_combination_and_concurrency_is_separate() -> None:
    settings, levels = sweep.parse(["max_num_seqs=8,16", "max-num-batched-tokens=512,1024", "concurrency=4,8"])
    assert levels == [4, 8]
    assert settings == [
        {"max_num_seqs": 8, "max_num_batched_tokens": 512}, {"max_num_seqs": 8, "max_num_batched_tokens": 1024},
        {"max_num_seqs": 16, "max_num_batched_tokens": 512}, {"max_num_seqs": 16, "max_num_batched_tokens": 1024},
    ]
    assert sweep.parse([]) == ([{}], None)
    assert sweep.parse(["batch_window_ms=0,2.5"])[0] == [{"batch_window_ms": 0}, {"batch_window_ms": 2.5}]
    assert sweep.parse(["dequantize=on,false"])[0] == [{"dequantize": True}, {"dequantize": False}]


@pytest.mark.parametrize("spec", ["max_num_seqs", "temperature=0,1", "max_num_seqs=a,b", "max_num_seqs=", "dequantize=maybe"])
def test_bad_sweeps(spec: str) -> None:
    with pytest.raises(ValueError, match="bad --sweep"):
        sweep.parse([spec])


def _row(label: str, goodput, tok_s: float) -> dict:
    return {"setting_label": label, "metrics": {"request_goodput": goodput, "output_throughput": tok_s}}


def test_best_prefers_goodput_then_throughput() -> None:
    assert sweep.best([_row("a", 1.0, 500), _row("b", 2.0, 100), _row("c", 2.0, 150)])["setting_label"] == "c"
    assert sweep.best([_row("a", None, 500), _row("b", None, 600)])["setting_label"] == "b"
    assert sweep.best([]) is None
    assert sweep.label({}) == "defaults" and sweep.label({"max_num_seqs": 8}) == "max_num_seqs=8"


def test_speculation_is_swept_off_and_on():
    settings, _ = sweep.parse(["speculative=off,ngram"])
    assert settings == [{"speculative": None}, {"speculative": "ngram"}]
    with pytest.raises(ValueError):
        sweep.parse(["speculative=eagle"])
