"""EngineConfig, DeviceConfig and PoolConfig: every engine knob, its default and its validation, in one place.

Environment variables only supply defaults, and this module is the only one that reads them:
each ``MLX_PARALLM_*`` knob is the default of one field (:data:`ENGINE_SETTINGS`,
:data:`DEVICE_SETTINGS`, :data:`POOL_SETTINGS`), and a field given explicitly wins over its variable. A bad value in
the environment is warned about and replaced (a typo in a replica's environment must not fail
every request); a bad explicit value raises :class:`~.errors.InvalidParameterError`.
:func:`cache_home`, :data:`ENGINE_CONFIG_ENV` and the compilers stay process-wide.
``python -m mlx_parallm_provider.config_reference`` prints the reference of it all.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Optional

from ._validation import Limit
from .errors import InvalidParameterError

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", "int8", "int4")
"""``EngineConfig.kv_cache_dtype``'s values ("auto": the model's own K/V dtype; "int8" / "int4":
quantized blocks)."""

ENGINE_CONFIG_ENV = "MLX_PARALLM_ENGINE_CONFIG"
HOME_ENV = "MLX_PARALLM_HOME"
OPENBLAS_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"
MARCH_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}"
"""What an ``-march`` value may look like (it goes on a compiler's command line)."""

PROCESS_VARIABLES = {
    HOME_ENV: "the cache folder: converted models (``models/``) and built kernels (``kernels/``); "
              "default ``~/.cache/mlx-parallm``.",
    ENGINE_CONFIG_ENV: "a JSON object of EngineConfig fields (``device`` a nested object of DeviceConfig "
                       "fields), e.g. ``{\"max_num_seqs\": 32, \"device\": {\"cpu_kernels\": false}}``: the "
                       "config of engines made without one (every engine of a LiteLLM proxy).",
    "CC": "the C compiler the kernels are built with (default ``cc``).",
    "CXX": "the C++ compiler the MLX extension is built with (default ``c++``).",
    OPENBLAS_TIMEOUT_ENV: "OpenBLAS's own variable; set to 4 before OpenBLAS loads unless already set "
                          "(its threads then sleep at once after a call instead of spinning).",
}
"""Variables read by the whole process, not a field of a config (the reference lists them)."""

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_text(name: str) -> str:
    """Environment variable ``name``, stripped ("" when unset)."""
    return os.environ.get(name, "").strip()


def env_choice(name: str) -> Optional[bool]:
    """Environment variable ``name`` as a yes / no: True for 1 / true / yes / on, False for
    0 / false / no / off (any case), None when unset or anything else."""
    value = env_text(name).lower()
    return True if value in _TRUE else False if value in _FALSE else None


def cache_home() -> Path:
    """The cache folder (``$MLX_PARALLM_HOME`` or ``~/.cache/mlx-parallm``), read at each call."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "mlx-parallm")


def c_compiler() -> str:
    """The C compiler for the kernels: ``$CC``, else ``cc``."""
    return os.environ.get("CC") or "cc"


def cxx_compiler() -> str:
    """The C++ compiler for the MLX extension: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX") or "c++"


def child_environment(**overrides: str) -> dict[str, str]:
    """This process's environment with ``overrides``, for a child process (benchmarks)."""
    return {**os.environ, **overrides}


def default_environment(name: str, value: str) -> None:
    """Set environment variable ``name`` for libraries that read it (OpenBLAS) unless the
    user set it."""
    os.environ.setdefault(name, value)


# -- settings: their limits, variables and how a variable's text is read --------------------


@dataclass(frozen=True)
class Setting:
    """One field's allowed values, and where it has one, the environment variable that gives
    its default (``parse`` reads the variable's text; ValueError: warned about, ``default``)."""

    limit: Limit
    env: Optional[str] = None
    default: Any = None
    parse: Optional[Callable[[str], Any]] = None

    def from_env(self, name: str) -> Any:
        """The value the environment gives field ``name``: :attr:`default` where unset or bad
        (warned), an integer out of range clamped into it (warned)."""
        raw = env_text(self.env) if self.env else ""
        if not raw:
            return self.default
        try:
            value = (self.parse or _parse_int)(raw)
        except ValueError as error:
            logger.warning("%s=%r is not %s: using %r", self.env, raw, error or "valid", self.default)
            return self.default
        if self.limit.kind == "int" and isinstance(value, int):
            low = self.limit.minimum if self.limit.minimum is not None else value
            high = self.limit.maximum if self.limit.maximum is not None else value
            bounded = int(min(max(value, low), high))
            if bounded != value:
                logger.warning("%s=%d is outside %s: using %d", self.env, value, self.limit.describe(), bounded)
            value = bounded
        try:
            self.limit.check(name, value)
        except InvalidParameterError as error:
            logger.warning("%s=%r: %s: using %r", self.env, raw, error, self.default)
            return self.default
        return value


def _parse_int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("an integer") from None


def _parse_choice(raw: str) -> bool:
    value = raw.lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError("1 / true / yes / on or 0 / false / no / off")


def _parse_blas(raw: str) -> str:
    return "off" if raw.lower() in ("off", "0", "none", "false") else "auto" if raw.lower() == "auto" else raw


def _parse_word(raw: str) -> str:
    return raw.strip().lower()


def _parse_int8(raw: str) -> int:
    if raw in ("8", "16"):
        return int(raw)
    try:
        return 8 if _parse_choice(raw) else 0
    except ValueError:
        raise ValueError("0, 1, 8 or 16") from None


def _parse_march(raw: str) -> Optional[str]:
    return None if raw == "native" else raw


def _parse_number(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError("a number") from None


PAGED_ATTENTION = ("auto", "kernel", "gather")
"""How a GPU attends over paged KV (:attr:`DeviceConfig.paged_attention`)."""

DEVICE_SETTINGS: dict[str, Setting] = {
    "cpu_kernels": Setting(Limit("bool", optional=True), "MLX_PARALLM_CPU_OPS", None, _parse_choice),
    "blas": Setting(Limit("text", words="'auto' / 'off' / a library path"), "MLX_PARALLM_BLAS", "auto", _parse_blas),
    "small_batch_rows": Setting(Limit("int", 0, 64), "MLX_PARALLM_SMALL_BATCH_ROWS", 4),
    "qmatmul_threads": Setting(Limit("int", 1, 16, optional=True), "MLX_PARALLM_QMATMUL_THREADS"),
    "attention_threads": Setting(Limit("int", 1, 256, optional=True), "MLX_PARALLM_ATTENTION_THREADS"),
    "int8_matmul": Setting(Limit("choice", choices=(0, 8, 16), optional=True), "MLX_PARALLM_INT8_MATMUL", None, _parse_int8),
    "float32_weights": Setting(Limit("bool"), "MLX_PARALLM_FLOAT32_WEIGHTS", False, _parse_choice),
    "kernel_march": Setting(Limit("text", optional=True, pattern=MARCH_PATTERN, words="an -march name (e.g. 'x86-64-v3') / None"),
                            "MLX_PARALLM_KERNEL_MARCH", None, _parse_march),
    "amx": Setting(Limit("bool"), "MLX_PARALLM_AMX", True, _parse_choice),
    "paged_attention": Setting(Limit("choice", choices=PAGED_ATTENTION), "MLX_PARALLM_PAGED_ATTENTION", "auto", _parse_word),
}
""":class:`DeviceConfig`'s fields: limits, variables, built-in defaults."""

ENGINE_SETTINGS: dict[str, Setting] = {
    "max_num_seqs": Setting(Limit("int", 1)),
    "max_num_batched_tokens": Setting(Limit("int", 1)),
    "prefill_chunk_size": Setting(Limit("int", 1)),
    "batch_window_ms": Setting(Limit("number", 0.0, 10_000.0)),
    "max_queue": Setting(Limit("int", 0)),
    "kv_cache_memory_gb": Setting(Limit("number", 0.0, optional=True, positive=True, hint="None disables the budget")),
    "max_kv_size": Setting(Limit("int", 8, optional=True)),
    "request_timeout_s": Setting(Limit("number", 0.0, optional=True, positive=True, hint="None disables it")),
    "dequantize": Setting(Limit("bool", optional=True), "MLX_PARALLM_DEQUANTIZE", None, _parse_choice),
    "enable_prefix_caching": Setting(Limit("bool")),
    "prefix_cache_memory_gb": Setting(Limit("number", 0.0, positive=True, hint="enable_prefix_caching=False turns the store off")),
    "kv_block_size": Setting(Limit("int", 1, 4096)),
    "kv_cache_dtype": Setting(Limit("choice", choices=KV_CACHE_DTYPES)),
    "kv_disk_path": Setting(Limit("text", optional=True)),
    "kv_disk_gb": Setting(Limit("number", 0.0, positive=True)),
    "shutdown_timeout_s": Setting(Limit("number", 0.0, 3600.0)),
    "speculative": Setting(Limit("choice", choices=("ngram",), optional=True)),
    "num_speculative_tokens": Setting(Limit("int", 1, 64)),
    "speculative_max_batch": Setting(Limit("int", 1)),
    "grammar_fast_forward": Setting(Limit("bool")),
    "async_scheduling": Setting(Limit("bool")),
    "stream_interval": Setting(Limit("int", 1, 4096)),
    "max_loras": Setting(Limit("int", 1, 1024)),
}
""":class:`EngineConfig`'s fields (``device`` aside): limits, and the variable where one gives the default."""


def _env_default(table: dict[str, Setting], name: str) -> Callable[[], Any]:
    return lambda: table[name].from_env(name)


def _device(name: str) -> Any:
    return field(default_factory=_env_default(DEVICE_SETTINGS, name))


class _CheckedSettings:
    """A frozen dataclass of the settings in ``_SETTINGS``, each checked against its limit when
    made (:class:`DeviceConfig`, :class:`PoolConfig`)."""

    _SETTINGS: ClassVar[dict[str, Setting]]

    def __post_init__(self) -> None:
        for name, setting in self._SETTINGS.items():
            setting.limit.check(name, getattr(self, name))

    def as_dict(self) -> dict[str, Any]:
        """Plain dict of every setting."""
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class DeviceConfig(_CheckedSettings):
    """How one engine computes on its device (the CPU kernels and their knobs).

    Every field's default comes from its environment variable (listed in
    ``docs/configuration.md``) where set, else the built-in default; an explicit value wins.
    Most are the engine's own, so two engines of one process may differ; ``blas``,
    ``kernel_march`` and ``amx`` are per process, as noted.

    Attributes:
        cpu_kernels: whether the model runs on this package's CPU kernels (fused attention,
            RMSNorm, RoPE, SwiGLU, small-batch matmuls over the packed weights) instead of
            MLX's own ops. None: on the CPU device only.
        blas: the BLAS MLX's CPU matmuls use: ``"auto"`` (the system OpenBLAS), ``"off"``
            (MLX's bundled reference BLAS) or a library path. Per process: the library is
            loaded globally once, before this package first imports mlx (with the process
            default, this field's variable); an engine asking for another is warned about.
            Where mlx was imported first, each engine's model binds it privately.
        small_batch_rows: steps of at most this many rows multiply quantized layers by their
            packed weights through the C kernel (wider steps through the panel GEMM or
            float32 copies); 0 turns the packed-weight kernel off.
        qmatmul_threads: threads of the packed-weight kernel (its helpers take shares of a
            call's rows as they come free). None: 2 where the machine has two CPUs or more.
        attention_threads: threads of the decode-attention kernel. None: the CPU count, up to 8.
        int8_matmul: quantized layers multiply every row count by integer dot products, with
            activations quantized in blocks of 32 to 16 bits (16: the float path's numerics,
            needs AVX-512 VNNI; on a CPU without it 8 is used) or 8 bits (8: llama.cpp's
            numerics); 0: the float kernels. None: 16 where the kernel has its AVX-512 VNNI
            tiles, else 0.
        float32_weights: quantized layers also keep a float32 copy of their weights for large
            steps (OpenBLAS's GEMM over it) instead of dequantizing tiles of the packed
            weights as they go; more memory.
        kernel_march: the ``-march`` the C kernels and the MLX extension are built with
            instead of ``native``: a lesser ISA of this CPU (e.g. ``x86-64-v3``) to run and
            measure that path; one this CPU cannot run is warned about and ignored. Per
            process: the kernels are built and loaded once, for the first engine's value.
        amx: the int8 path multiplies on Intel AMX tiles where the CPU and Linux give them;
            False keeps them off. Per process: the loaded kernel's state, set by each engine
            that loads a model (the last one wins).
        paged_attention: on a GPU (Metal, CUDA), how attention reads the paged KV:
            ``"kernel"``, this package's kernels read it through the block tables;
            ``"gather"``, each row's blocks are copied into a rectangle for MLX's attention;
            ``"auto"``, the kernels where their check at first use passes, else the gather.
    """

    _SETTINGS: ClassVar[dict[str, Setting]] = DEVICE_SETTINGS
    cpu_kernels: Optional[bool] = _device("cpu_kernels")
    blas: str = _device("blas")
    small_batch_rows: int = _device("small_batch_rows")
    qmatmul_threads: Optional[int] = _device("qmatmul_threads")
    attention_threads: Optional[int] = _device("attention_threads")
    int8_matmul: Optional[int] = _device("int8_matmul")
    float32_weights: bool = _device("float32_weights")
    kernel_march: Optional[str] = _device("kernel_march")
    amx: bool = _device("amx")
    paged_attention: str = _device("paged_attention")

    @classmethod
    def from_env(cls, **overrides: Any) -> "DeviceConfig":
        """The environment's defaults, ``overrides`` replacing them (the same as ``DeviceConfig(**overrides)``)."""
        return cls(**overrides)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "device") -> "DeviceConfig":
        """A config from a mapping of field names (a JSON object), unknown names refused."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidParameterError(where, f"has unknown DeviceConfig fields {unknown}")
        return cls(**values)



@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine (one loaded model).

    Attributes:
        max_num_seqs: most requests decoding at once (the decode batch size cap).
        max_num_batched_tokens: most tokens (decode rows + prefill tokens, padding
            included) one step may process; bounds how much prefill is mixed into a step.
            At least ``max_num_seqs``, so that a full decode step fits.
        prefill_chunk_size: prompts longer than this are prefilled in chunks of this size,
            one chunk per step, so running streams keep producing tokens meanwhile.
        batch_window_ms: when the engine is idle, how long the first arrival waits for
            others so that a burst is prefilled together (0 disables the wait).
        max_queue: most requests waiting for a slot; beyond it submissions fail at once
            with :class:`~mlx_parallm_provider.errors.EngineOverloadedError`.
        kv_cache_memory_gb: the KV block pool's size, allocated at once, prefix store
            included; requests are admitted by free blocks and the newest is preempted
            (recomputed later) when decoding rows run out. None: room for every slot at its
            full context, at most half the memory free at start, grown as blocks are used.
        max_kv_size: if set, each row attends to at most this many recent KV entries (as
            mlx-lm's ``--max-kv-size``): lower memory, longer generations, approximate
            attention past the window (batched rows keep none of the first tokens, unlike
            mlx-lm's single-sequence cache, which keeps 4). Every layer gets that
            window and a row's blocks that left it go back to the pool as it decodes.
        request_timeout_s: default per-request timeout (None: no timeout); a request's
            own ``SamplingParams.timeout`` takes precedence.
        dequantize: dequantize weights at load (None: on the CPU device only).
        enable_prefix_caching: reuse the KV of prompt prefixes across requests (vLLM's
            name): a prefix shared by requests arriving together is prefilled once, and
            the KV of finished prompts and answers is kept for later requests (the next
            wave of an agent, turn 2 of a conversation). False: every prompt is prefilled
            in full.
        prefix_cache_memory_gb: most KV memory the prefix store's blocks may hold (least
            recently used blocks are evicted past it), within the pool (``kv_cache_memory_gb``).
        kv_block_size: tokens per KV block (the KV cache is a pool of blocks: see the README's
            "KV memory").
        kv_cache_dtype: the KV blocks' dtype (vLLM's name): ``"auto"``, that of the model's
            own K and V (float32 on the CPU, where models compute in float32); ``"float16"``
            halves the KV memory of a CPU engine (as llama.cpp's default f16 cache), the
            CPU's decode kernel widening each value as it reads it; ``"bfloat16"`` (on the
            CPU its blocks are gathered for MLX's ops every step: slower), ``"float32"``;
            ``"int8"`` / ``"int4"`` quantize each token's K and V in groups of 32 values
            (a float16 scale and bias a group, as ``mx.quantize``): ~1.8x / ~3.2x the
            tokens of float16 in one budget, with a small loss of accuracy (docs/kv-memory.md).
            Attention computes in the model's dtype either way.
        kv_disk_path: a folder for the prefix store's disk tier (None: none): whole KV blocks
            of prompts and answers are also written there (off the step loop), named by
            their tokens and the model and KV settings, and a prompt whose prefix the
            memory store lacks loads its blocks from there instead of prefilling them; it
            lasts across restarts and several processes (replicas) share one folder.
            Needs ``enable_prefix_caching``; models mixing sliding-window and global layers
            (gemma3) have none.
        kv_disk_gb: the disk tier's bound: past it the least recently used block files are
            deleted.
        speculative: ``"ngram"``: rows draft up to ``num_speculative_tokens`` tokens a step
            from their own prompt + output (prompt lookup) and verify them in one forward
            pass, while at most ``speculative_max_batch`` rows decode and none has penalties,
            a logit bias, a constraint or logprobs; greedy and sampled
            rows alike give the tokens they give without. None: off.
        num_speculative_tokens: most draft tokens per row and step.
        speculative_max_batch: speculate (and fast-forward) only while at most this many
            rows decode (8: measured, fast-forward of tool calls paid at 1, 2, 4 and 8 rows
            once verify steps read the KV blocks in place; it was 2 while they gathered them).
        grammar_fast_forward: constrained rows verify the tokens their grammar forces in one
            forward pass with the token they decode, instead of one step each (output unchanged, see :mod:`~mlx_parallm_provider.engine.fast_forward`).
        async_scheduling: while a decode step computes, build and queue the next one on its
            still-lazy tokens (vLLM's ``async_scheduling``), where the tokens cannot differ:
            rows without penalties, bias, grammar or logprobs (greedy or seeded alike), no prompt that could be admitted, no n-gram drafts to
            verify at that step
            (:mod:`~mlx_parallm_provider.engine.decode_ahead`).
        stream_interval: a streaming request gets a delta every this many tokens (its first
            token, and its last, at once), as vLLM's ``--stream-interval``: fewer, larger
            deltas cost the caller's event loop (LiteLLM's proxy handles each chunk) less CPU
            at high concurrency; 1 streams every token.
        max_loras: most LoRA adapters resident on the model at once (vLLM's name): a batch may
            mix rows of all of them and rows of none; an adapter no running request uses
            makes room for another (least recently used first), and when every one is in
            use a request for another fails with
            :class:`~mlx_parallm_provider.errors.EngineOverloadedError`.
        shutdown_timeout_s: how long shutting down waits for the step in progress; past
            it, requests still in flight fail with
            :class:`~mlx_parallm_provider.errors.EngineDeadError` at once and, at
            interpreter exit, the process ends without waiting for the step.
        device: how the engine computes on its device (:class:`DeviceConfig`; a mapping of
            its fields is taken too).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    batch_window_ms: float = 5.0
    max_queue: int = 1024
    kv_cache_memory_gb: Optional[float] = None
    max_kv_size: Optional[int] = None
    request_timeout_s: Optional[float] = None
    dequantize: Optional[bool] = field(default_factory=_env_default(ENGINE_SETTINGS, "dequantize"))
    enable_prefix_caching: bool = True
    prefix_cache_memory_gb: float = 1.0
    kv_block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_disk_path: Optional[str] = None
    kv_disk_gb: float = 16.0
    shutdown_timeout_s: float = 5.0
    speculative: Optional[str] = None
    num_speculative_tokens: int = 4
    speculative_max_batch: int = 8
    grammar_fast_forward: bool = True
    async_scheduling: bool = True
    stream_interval: int = 1
    max_loras: int = 8
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def __post_init__(self) -> None:
        for name, setting in ENGINE_SETTINGS.items():
            setting.limit.check(name, getattr(self, name))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidParameterError(
                "max_num_batched_tokens",
                f"must be >= max_num_seqs ({self.max_num_seqs}) so a full decode step fits",
            )
        if self.kv_disk_path is not None and not self.enable_prefix_caching:
            raise InvalidParameterError("kv_disk_path", "needs enable_prefix_caching (the disk tier stores the prefix store's blocks)")
        if isinstance(self.device, Mapping):
            object.__setattr__(self, "device", DeviceConfig.from_dict(self.device))
        elif not isinstance(self.device, DeviceConfig):
            raise InvalidParameterError("device", f"must be a DeviceConfig or a mapping of its fields, got {self.device!r}")

    @property
    def kv_cache_memory_bytes(self) -> Optional[int]:
        """The KV budget in bytes, or None."""
        return None if self.kv_cache_memory_gb is None else int(self.kv_cache_memory_gb * 1024**3)

    @property
    def kv_disk_bytes(self) -> int:
        """The disk tier's bound in bytes."""
        return int(self.kv_disk_gb * 1024**3)

    @property
    def prefix_cache_memory_bytes(self) -> int:
        """The prefix store's bound in bytes."""
        return int(self.prefix_cache_memory_gb * 1024**3)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict of every setting (JSON-serialisable: ``device`` a nested dict)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["device"] = self.device.as_dict()
        return values

    @classmethod
    def from_env(cls, variable: str = ENGINE_CONFIG_ENV) -> "EngineConfig":
        """The config a JSON object in the environment variable sets (e.g.
        ``{"max_num_seqs": 32, "device": {"cpu_kernels": false}}``), defaults (each from its
        own variable where it has one) for the rest; the defaults alone when it is unset.
        Engines made without a config (every engine of a LiteLLM proxy) use it, so each
        replica of a cluster can be sized by its host."""
        raw = env_text(variable)
        if not raw:
            return cls()
        try:
            values = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InvalidParameterError(variable, f"is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise InvalidParameterError(variable, "must be a JSON object of EngineConfig fields")
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidParameterError(variable, f"has unknown EngineConfig fields {unknown}")
        if "device" in values:
            if not isinstance(values["device"], dict):
                raise InvalidParameterError(variable, "'device' must be a JSON object of DeviceConfig fields")
            values["device"] = DeviceConfig.from_dict(values["device"], f"{variable} device")
        return cls(**values)


def default_blas() -> str:
    """The process's BLAS choice before any engine exists (:attr:`DeviceConfig.blas`'s default)."""
    return DEVICE_SETTINGS["blas"].from_env("blas")


def default_dequantize() -> Optional[bool]:
    """:attr:`EngineConfig.dequantize`'s default (``MLX_PARALLM_DEQUANTIZE``), for models loaded without an engine."""
    return ENGINE_SETTINGS["dequantize"].from_env("dequantize")


POOL_SETTINGS: dict[str, Setting] = {
    "memory_gb": Setting(Limit("number", 0.0, optional=True, positive=True, hint="None: no budget"), "MLX_PARALLM_POOL_MEMORY_GB",
                         None, _parse_number),
    "idle_unload_s": Setting(Limit("number", 0.0, optional=True, positive=True, hint="None: never"), "MLX_PARALLM_POOL_IDLE_UNLOAD_S",
                             None, _parse_number),
    "load_wait_s": Setting(Limit("number", 0.0, 3600.0), "MLX_PARALLM_POOL_LOAD_WAIT_S", 30.0, _parse_number),
}
""":class:`PoolConfig`'s fields: limits, variables, built-in defaults."""


def _pool(name: str) -> Any:
    return field(default_factory=_env_default(POOL_SETTINGS, name))


@dataclass(frozen=True)
class PoolConfig(_CheckedSettings):
    """The process's model pool: every engine :func:`~mlx_parallm_provider.get_engine` makes
    (one per model name) shares one memory budget. Per process: set it with
    :func:`~mlx_parallm_provider.configure_pool` or the variables below (read when the pool is
    first used); the defaults keep every model loaded for the life of the process.

    Attributes:
        memory_gb: the budget for every pooled model's weights and KV pool together (a
            model's weights: every array its modules hold; its KV: ``kv_cache_memory_gb``
            where set, else the KV arrays allocated so far). Loading or waking a model that
            does not fit puts the least recently used idle model to sleep first (never one
            with requests in flight); a model larger than the whole budget is refused with
            :class:`~mlx_parallm_provider.errors.ModelLoadError`. None: no budget.
        idle_unload_s: a model without requests for this long is put to sleep (weights and
            KV freed, the engine kept; the next request wakes it). None: never.
        load_wait_s: how long a load waits for a busy model to become idle so it can be put to
            sleep; past it the load fails with
            :class:`~mlx_parallm_provider.errors.EngineOverloadedError`.
    """

    _SETTINGS: ClassVar[dict[str, Setting]] = POOL_SETTINGS
    memory_gb: Optional[float] = _pool("memory_gb")
    idle_unload_s: Optional[float] = _pool("idle_unload_s")
    load_wait_s: float = _pool("load_wait_s")

    @property
    def memory_bytes(self) -> Optional[int]:
        """The budget in bytes, or None."""
        return None if self.memory_gb is None else int(self.memory_gb * 1024**3)
