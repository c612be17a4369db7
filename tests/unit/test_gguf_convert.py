"""GGUF -> mlx-lm folder conversion: exact weights, clear errors, atomic output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_CONFIG
from gguf_fixtures import tokenizer_metadata, write_llama_gguf
from mlx_parallm_provider.cli import main as cli_main
from mlx_parallm_provider.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from mlx_parallm_provider.models.gguf import convert_gguf


@pytest.fixture(scope="module")
def tiny_params():
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    mx.random.seed(1)
    model = llama.Model(llama.ModelArgs.from_dict(TINY_CONFIG))
    return model, dict(tree_flatten(model.parameters()))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_params, default_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, params = tiny_params
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return write_llama_gguf(path, params, TINY_CONFIG, tokenizer_metadata(default_gguf))


def test_converted_model_computes_the_same_logits(tiny_params, tiny_gguf: Path, tmp_path: Path) -> None:
    import mlx.core as mx
    import mlx_lm

    original, _ = tiny_params
    out = convert_gguf(tiny_gguf, tmp_path / "converted")
    converted, tokenizer = mlx_lm.load(str(out))
    tokens = mx.array([tokenizer.encode("The capital of France is", add_special_tokens=False)])
    assert mx.array_equal(original(tokens), converted(tokens))
    config = json.loads((out / "config.json").read_text())
    assert config["rope_traditional"] is False and config["tie_word_embeddings"] is True
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())


def test_into_existing_empty_folder(tiny_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    out = convert_gguf(tiny_gguf, tmp_path / "out")
    assert (out / "model.safetensors").is_file()


def test_refuses_non_empty_output_folder(tiny_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ModelLoadError, match="not empty"):
        convert_gguf(tiny_gguf, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_crash_mid_conversion_leaves_nothing(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", explode)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(tiny_gguf, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def unsupported_gguf(tiny_params, default_gguf: Path, tmp_path: Path) -> Path:
    _, params = tiny_params
    return write_llama_gguf(tmp_path / "qwen.gguf", params, TINY_CONFIG, tokenizer_metadata(default_gguf), architecture="falcon")


@pytest.fixture
def truncated_gguf(tiny_gguf: Path, tmp_path: Path) -> Path:
    data = tiny_gguf.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize(
    "case, error, reason",
    [
        ("unsupported", UnsupportedModelError, "architecture 'falcon' is not supported"),
        ("truncated", ModelLoadError, "truncated"),
        ("missing", ModelNotFoundError, "no such GGUF file"),
    ],
)
def test_bad_input_gives_one_line_error(case, error, reason, request, tmp_path: Path, capsys) -> None:
    path = {
        "unsupported": lambda: request.getfixturevalue("unsupported_gguf"),
        "truncated": lambda: request.getfixturevalue("truncated_gguf"),
        "missing": lambda: tmp_path / "missing.gguf",
    }[case]()
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(error, match=reason):
        convert_gguf(path, out)

    assert cli_main(["convert", str(path), str(out)]) == 1
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and str(path) in stderr and reason in stderr
    assert "Traceback" not in stderr
    assert list(out.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"out", path.name} - ({path.name} if case == "missing" else set()))


def test_cli_process_exit_status(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mlx_parallm_provider.cli", "convert", str(tmp_path / "nope.gguf"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"mlx-parallm: error: {tmp_path / 'nope.gguf'}: no such GGUF file"]
    assert not (tmp_path / "out").exists()


# Issue 21 item 14: a header value of 0 (or one that does not fit the others) was a raw
# ZeroDivisionError / reshape error; the LiteLLM provider answered a generic 500.
BAD_HEADERS = [
    ({"attention.head_count": 0}, "llama.attention.head_count = 0"),
    ({"attention.head_count_kv": 0}, "llama.attention.head_count_kv = 0"),
    ({"embedding_length": 0, "attention.key_length": None}, "llama.embedding_length = 0"),
    ({"feed_forward_length": 0}, "llama.feed_forward_length = 0"),
    ({"block_count": 0}, "llama.block_count = 0"),
    ({"block_count": 3}, "llama.block_count = 3, but the file holds tensors of 2 blocks"),
    ({"attention.head_count_kv": 3}, "llama.attention.head_count (4) is not a multiple of llama.attention.head_count_kv (3)"),
    ({"attention.key_length": 32}, "heads of 32 need"),  # tensor 'blk.N.attn_q.weight' has 64 rows, ... need 128
    ({"attention.head_count": 3, "attention.head_count_kv": 1}, "llama.embedding_length (64) is not a multiple of llama.attention.head_count (3)"),
    ({"context_length": 0}, "llama.context_length = 0"),
    ({"attention.head_count": "four"}, "llama.attention.head_count = 'four'"),
]


@pytest.mark.parametrize(("header", "reason"), BAD_HEADERS)
def test_bad_header_values_are_a_model_load_error_naming_the_key(header, reason, tiny_params, default_gguf: Path, tmp_path: Path) -> None:
    _, params = tiny_params
    path = write_llama_gguf(tmp_path / "bad.gguf", params, TINY_CONFIG, tokenizer_metadata(default_gguf), header=header)
    with pytest.raises(ModelLoadError, match=re.escape(reason)) as info:
        convert_gguf(path, tmp_path / "out")
    assert "invalid GGUF header" in str(info.value) and str(path) in str(info.value)
    assert not (tmp_path / "out").exists()


def test_a_bad_header_through_litellm_is_a_bad_request_naming_the_key(tiny_params, default_gguf: Path, tmp_path: Path) -> None:
    import litellm

    from mlx_parallm_provider import register, shutdown_engines

    _, params = tiny_params
    path = write_llama_gguf(tmp_path / "zero-heads.gguf", params, TINY_CONFIG, tokenizer_metadata(default_gguf), header={"attention.head_count": 0})
    register()
    try:
        with pytest.raises(litellm.BadRequestError, match=re.escape("llama.attention.head_count = 0")) as info:
            litellm.completion(model=f"mlx-parallm/{path}", messages=[{"role": "user", "content": "Hi"}])
        assert "ModelLoadError" in str(info.value)
    finally:
        shutdown_engines()
