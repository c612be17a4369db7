"""EngineConfig: every engine knob, its default and its validation, in one place."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Optional

from ._validation import check_int as _check_int
from ._validation import check_number as _check_number
from .errors import InvalidParameterError


KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32")
"""``EngineConfig.kv_cache_dtype``'s values ("auto": the model's own K/V dtype)."""


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine (one loaded model).

    Attributes:
        max_num_seqs: most requests decoding at once (the decode batch size cap).
        max_num_batched_tokens: most tokens (decode rows + prefill tokens, padding
            included) one step may process; bounds how much prefill is mixed into a step.
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
            CPU its blocks are gathered for MLX's ops every step: slower), ``"float32"``.
            Attention computes in the model's dtype either way.
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
            rows without penalties, bias, grammar or logprobs (greedy or seeded alike), no prompt that could be admitted, no n-gram drafts to verify at that step
            (:mod:`~mlx_parallm_provider.engine.decode_ahead`).
        stream_interval: a streaming request gets a delta every this many tokens (its first
            token, and its last, at once), as vLLM's ``--stream-interval``: fewer, larger
            deltas cost the caller's event loop (LiteLLM's proxy handles each chunk) less CPU
            at high concurrency; 1 streams every token.
        shutdown_timeout_s: how long shutting down waits for the step in progress; past
            it, requests still in flight fail with
            :class:`~mlx_parallm_provider.errors.EngineDeadError` at once and, at
            interpreter exit, the process ends without waiting for the step.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    batch_window_ms: float = 5.0
    max_queue: int = 1024
    kv_cache_memory_gb: Optional[float] = None
    max_kv_size: Optional[int] = None
    request_timeout_s: Optional[float] = None
    dequantize: Optional[bool] = None
    enable_prefix_caching: bool = True
    prefix_cache_memory_gb: float = 1.0
    kv_block_size: int = 16
    kv_cache_dtype: str = "auto"
    shutdown_timeout_s: float = 5.0
    speculative: Optional[str] = None
    num_speculative_tokens: int = 4
    speculative_max_batch: int = 8
    grammar_fast_forward: bool = True
    async_scheduling: bool = True
    stream_interval: int = 1

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        _check_int("prefill_chunk_size", self.prefill_chunk_size, minimum=1)
        _check_number("batch_window_ms", self.batch_window_ms, minimum=0.0, maximum=10_000.0)
        _check_int("max_queue", self.max_queue, minimum=0)
        _check_number("shutdown_timeout_s", self.shutdown_timeout_s, minimum=0.0, maximum=3600.0)
        if self.kv_cache_memory_gb is not None:
            _check_number("kv_cache_memory_gb", self.kv_cache_memory_gb, minimum=0.0)
            if self.kv_cache_memory_gb == 0:
                raise InvalidParameterError("kv_cache_memory_gb", "must be > 0 (None disables the budget)")
        if self.max_kv_size is not None:
            _check_int("max_kv_size", self.max_kv_size, minimum=8)
        if self.request_timeout_s is not None:
            _check_number("request_timeout_s", self.request_timeout_s, minimum=0.0)
            if self.request_timeout_s == 0:
                raise InvalidParameterError("request_timeout_s", "must be > 0 (None disables it)")
        if self.dequantize is not None and not isinstance(self.dequantize, bool):
            raise InvalidParameterError("dequantize", "must be a bool or None")
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidParameterError("enable_prefix_caching", "must be a bool")
        _check_number("prefix_cache_memory_gb", self.prefix_cache_memory_gb, minimum=0.0)
        if self.prefix_cache_memory_gb == 0:
            raise InvalidParameterError("prefix_cache_memory_gb", "must be > 0 (enable_prefix_caching=False turns the store off)")
        _check_int("kv_block_size", self.kv_block_size, minimum=1, maximum=4096)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidParameterError("kv_cache_dtype", f"must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, got {self.kv_cache_dtype!r}")
        if self.speculative not in (None, "ngram"):
            raise InvalidParameterError("speculative", f"must be 'ngram' or None, got {self.speculative!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, minimum=1, maximum=64)
        _check_int("speculative_max_batch", self.speculative_max_batch, minimum=1)
        if not isinstance(self.grammar_fast_forward, bool):
            raise InvalidParameterError("grammar_fast_forward", "must be a bool")
        if not isinstance(self.async_scheduling, bool):
            raise InvalidParameterError("async_scheduling", "must be a bool")
        _check_int("stream_interval", self.stream_interval, minimum=1, maximum=4096)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidParameterError(
                "max_num_batched_tokens",
                f"must be >= max_num_seqs ({self.max_num_seqs}) so a full decode step fits",
            )

    @property
    def kv_cache_memory_bytes(self) -> Optional[int]:
        """The KV budget in bytes, or None."""
        return None if self.kv_cache_memory_gb is None else int(self.kv_cache_memory_gb * 1024**3)

    @property
    def prefix_cache_memory_bytes(self) -> int:
        """The prefix store's bound in bytes."""
        return int(self.prefix_cache_memory_gb * 1024**3)

    def as_dict(self) -> dict:
        """Plain dict of every setting."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_env(cls, variable: str = "MLX_PARALLM_ENGINE_CONFIG") -> "EngineConfig":
        """The config a JSON object in the environment variable sets (e.g.
        ``{"max_num_seqs": 32, "prefix_cache_memory_gb": 4}``), defaults for the rest; the
        defaults alone when it is unset. Engines made without a config (every engine of a
        LiteLLM proxy) use it, so each replica of a cluster can be sized by its host."""
        raw = os.environ.get(variable, "").strip()
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
        return cls(**values)
