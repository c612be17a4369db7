""":class:`EngineConfig`: the settings of one engine (one loaded model), ``device`` among them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

from .._validation import Limit
from ..errors import InvalidParameterError
from .device import DeviceConfig
from .environment import ENGINE_CONFIG_ENV, env_text
from .settings import Setting, parse_choice, setting_field

KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", "int8", "int4")
"""``EngineConfig.kv_cache_dtype``'s values ("auto": the model's own K/V dtype; "int8" / "int4":
quantized blocks)."""

ENGINE_SETTINGS: dict[str, Setting] = {
    "max_num_seqs": Setting(Limit("int", 1)),
    "max_num_batched_tokens": Setting(Limit("int", 1)),
    "prefill_chunk_size": Setting(Limit("int", 1)),
    "batch_window_ms": Setting(Limit("number", 0.0, 10_000.0)),
    "max_queue": Setting(Limit("int", 0)),
    "kv_cache_memory_gb": Setting(Limit("number", 0.0, optional=True, positive=True, hint="None disables the budget")),
    "max_kv_size": Setting(Limit("int", 8, optional=True)),
    "request_timeout_s": Setting(Limit("number", 0.0, optional=True, positive=True, hint="None disables it")),
    "dequantize": Setting(Limit("bool", optional=True), "MLX_PARALLM_DEQUANTIZE", None, parse_choice),
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
            full context, at most half the memory free at start (the GPU's on a GPU), grown
            as blocks are used.
        max_kv_size: if set, each row attends to at most this many recent KV entries (as
            mlx-lm's ``--max-kv-size``): lower memory, longer generations, approximate
            attention past the window (batched rows keep none of the first tokens, unlike
            mlx-lm's single-sequence cache, which keeps 4). Every layer gets that
            window and a row's blocks that left it go back to the pool as it decodes.
        request_timeout_s: default per-request timeout (None: no timeout); a request's
            own ``SamplingParams.timeout`` takes precedence.
        dequantize: dequantize weights at load, computing in float32 on the CPU and in the
            checkpoint's own 16-bit precision on a GPU (None: on the CPU device only).
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
            pass, while at most ``speculative_max_batch`` rows decode and none has a
            constraint or logprobs; greedy and sampled rows alike (penalties and logit bias
            included) give the tokens they give without. None: off.
        num_speculative_tokens: most draft tokens per row and step.
        speculative_max_batch: speculate (and fast-forward) only while at most this many
            rows decode (8: measured, fast-forward of tool calls paid at 1, 2, 4 and 8 rows
            once verify steps read the KV blocks in place; it was 2 while they gathered them).
        grammar_fast_forward: constrained rows verify the tokens their grammar forces in one
            forward pass with the token they decode, instead of one step each (output unchanged, see :mod:`~mlx_parallm_provider.engine.fast_forward`).
        async_scheduling: while a decode step computes, build and queue the next one on its
            still-lazy tokens (vLLM's ``async_scheduling``), where the tokens cannot differ:
            rows without grammar or logprobs (greedy or seeded alike; penalties count the
            token still on the device), no prompt that could be admitted, no n-gram drafts to
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
    dequantize: Optional[bool] = setting_field(ENGINE_SETTINGS, "dequantize")
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


def default_dequantize() -> Optional[bool]:
    """:attr:`EngineConfig.dequantize`'s default (``MLX_PARALLM_DEQUANTIZE``), for models loaded without an engine."""
    return ENGINE_SETTINGS["dequantize"].from_env("dequantize")
