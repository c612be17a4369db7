"""The public surface is small and pinned; the engine knows no chat; the fake and the
real engine share one protocol."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import mlx_parallm_provider
import mlx_parallm_provider.langchain
from fakes import FakeEngine
from mlx_parallm_provider.engine import Engine, EngineLike

PACKAGE = Path(mlx_parallm_provider.__file__).parent


def test_the_package_exports_exactly_its_documented_names() -> None:
    assert sorted(mlx_parallm_provider.__all__) == sorted([
        "BackendError", "Completion", "Constraint", "ContextWindowExceededError", "Delta", "DeviceConfig",
        "EmbeddingResult", "Engine", "EngineConfig", "EngineDeadError",
        "EngineLike", "EngineOverloadedError", "InvalidParameterError", "MLXParallmError", "ModelLoadError",
        "ModelNotFoundError", "PoolConfig", "RequestFailedError", "RequestTimeoutError", "SamplingParams", "TokenLogprob",
        "UnsupportedModelError", "Usage", "__version__", "configure_pool", "get_engine", "litellm_handler", "pool_stats", "register",
        "shutdown_engines",
    ])
    for name in mlx_parallm_provider.__all__:
        assert getattr(mlx_parallm_provider, name) is not None


def test_the_langchain_module_exports_the_two_models_and_the_embeddings() -> None:
    assert sorted(mlx_parallm_provider.langchain.__all__) == ["ChatMLXParallm", "MLXParallmEmbeddings", "MLXParallmLLM"]


def _imports(path: Path) -> set[str]:
    """Absolute names of the package modules ``path`` imports."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            target = f"{base}.{node.module}" if node.level and node.module else (base if node.level else node.module or "")
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return {n for n in names if n.startswith("mlx_parallm_provider")}


def _module_path(name: str) -> Path | None:
    parts = name.split(".")[1:]
    for candidate in (PACKAGE.joinpath(*parts).with_suffix(".py"), PACKAGE.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def test_the_engine_imports_nothing_from_chat_or_integrations() -> None:
    todo = list((PACKAGE / "engine").rglob("*.py"))
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            assert not name.startswith(("mlx_parallm_provider.chat", "mlx_parallm_provider.integrations")), (path, name)
            found = _module_path(name)
            if found is not None and found != PACKAGE / "__init__.py":
                todo.append(found)
    assert PACKAGE / "engine" / "api.py" in seen and PACKAGE / "engine" / "grammar" / "guided.py" in seen


def test_the_import_walk_sees_the_adapters_use_of_the_chat_layer() -> None:
    # The walk above would notice a chat import: it does see the adapters' ones.
    assert "mlx_parallm_provider.chat" in _imports(PACKAGE / "integrations" / "litellm.py")


def test_the_fake_and_the_real_engine_share_the_engine_like_protocol() -> None:
    assert isinstance(FakeEngine(), EngineLike)
    methods = [n for n, v in vars(EngineLike).items() if callable(v) and not n.startswith("_")]
    assert {"generate", "stream", "generate_sync", "stream_sync", "generate_many", "generate_many_sync", "stats"} <= set(methods)
    for name in methods:
        wanted = list(inspect.signature(getattr(EngineLike, name)).parameters)
        for cls in (Engine, FakeEngine):
            assert list(inspect.signature(getattr(cls, name)).parameters) == wanted, (cls.__name__, name)
            assert inspect.iscoroutinefunction(getattr(cls, name)) == inspect.iscoroutinefunction(getattr(EngineLike, name))


def test_no_module_of_the_engine_chat_layer_or_adapters_is_over_400_lines() -> None:
    for folder in ("engine", "chat", "integrations"):
        for path in (PACKAGE / folder).rglob("*.py"):
            assert len(path.read_text().splitlines()) <= 400, path
