"""llama.cpp through ``llama-cpp-python`` (the optional ``[llama-cpp]`` extra), on the GGUF file
itself: one context per run with one sequence per concurrent request, batched continuously by
:class:`~.llama_batch.BatchScheduler` (llama.cpp's low-level API, as ``llama-server`` does).

It is sent the same prompt token ids as the in-process systems (the engine's chat template and
tokenizer, which for a GGUF model are the file's own), so prompts and token counts match.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

from ..metrics import RequestRecord
from ..workloads import BenchRequest
from .base import OnDone, Runner, Sampling, SkipSystem
from .llama_batch import BatchScheduler, Job, serve_in_thread

#: llama.cpp's limit on sequences per context (LLAMA_MAX_SEQ); more requests queue
MAX_SEQUENCES = 256


def default_threads() -> int:
    """Half the CPUs (llama-cpp-python's default for generation; llama.cpp advises one thread
    per physical core): its threads spin-wait, and more threads than free cores slow it down."""
    return max(1, (os.cpu_count() or 2) // 2)


def gguf_path(model: str) -> Path:
    """The GGUF file behind a model name; :class:`SkipSystem` when there is none."""
    if model == "default":
        from ...models.registry import default_gguf_path

        return default_gguf_path()
    if model.endswith(".gguf"):
        return Path(model)
    raise SkipSystem(f"llama.cpp needs a .gguf model, not {model!r}")


#: the low-level functions the runner calls (llama.cpp's 2025 memory API among them)
REQUIRED = (
    "llama_backend_init", "llama_model_load_from_file", "llama_model_get_vocab", "llama_model_n_ctx_train",
    "llama_init_from_model", "llama_get_memory", "llama_memory_seq_rm", "llama_batch_init", "llama_decode",
    "llama_sampler_chain_init", "llama_sampler_init_greedy", "llama_sampler_sample", "llama_vocab_is_eog",
    "llama_sampler_init_top_k", "llama_sampler_init_top_p", "llama_sampler_init_min_p",
)


def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module; :class:`SkipSystem` when it is not installed or too old."""
    try:
        import llama_cpp
    except ImportError:
        raise SkipSystem("llama-cpp-python is not installed (pip install 'mlx-parallm-provider[llama-cpp]', which compiles llama.cpp)") from None
    missing = [name for name in REQUIRED if not hasattr(llama_cpp, name)]
    if missing:
        raise SkipSystem(f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')} is too old: no {', '.join(missing)}")
    return llama_cpp


class LlamaCpp(Runner):
    """llama.cpp with ``n_seq_max`` = the run's concurrency: prompts that arrive together are
    prefilled in one ``llama_decode``, every running sequence decodes in the same step, and a
    waiting request takes the sequence of one that finished. Greedy at temperature 0; EOS is
    any end-of-generation token of the vocabulary (not counted as output)."""

    def __init__(self, name: str, model: str, sampling: Sampling, ignore_eos: bool = False, threads: Optional[int] = None) -> None:
        super().__init__(name)
        self.threads = threads or default_threads()
        self.model_name = model
        self.sampling = sampling
        self.ignore_eos = ignore_eos
        self.eos = "ignored" if ignore_eos else "honoured"
        self.lib: Any = None
        self.model: Any = None
        self.vocab: Any = None
        self.n_ctx_train = 0
        self.ctx: Any = None
        self.scheduler: Optional[BatchScheduler] = None
        self._thread: Any = None
        self._max_decode_batch: Optional[int] = None  # of the last run, kept past its context

    async def start(self) -> None:
        self.lib = import_llama_cpp()
        path = gguf_path(self.model_name)
        if not path.is_file():
            raise SkipSystem(f"{path}: no such GGUF file")
        await asyncio.to_thread(self._load, path)

    def _load(self, path: Path) -> None:
        lib = self.lib
        # llama-cpp-python's log callback prints every info line unless its logger says otherwise.
        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        lib.llama_backend_init()
        self.model = lib.llama_model_load_from_file(str(path).encode(), lib.llama_model_default_params())
        if not self.model:
            raise SkipSystem(f"llama.cpp could not load {path}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_ctx_train = lib.llama_model_n_ctx_train(self.model)

    async def run(self, requests: Sequence[BenchRequest], offsets: Sequence[float], max_concurrency: Optional[int],
                  on_done: OnDone = None) -> tuple[list[RequestRecord], float]:
        """A fresh context sized for this run (its concurrency and longest request), then the run."""
        width = max(1, min(max_concurrency or len(requests), len(requests), MAX_SEQUENCES))
        longest = max((r.prompt_tokens + r.max_tokens for r in requests), default=1)
        await asyncio.to_thread(self._open, width, longest)
        try:
            return await super().run(requests, offsets, max_concurrency, on_done)
        finally:
            await asyncio.to_thread(self._close)

    def _open(self, width: int, longest: int) -> None:
        lib = self.lib
        n_ctx = width * min(longest, self.n_ctx_train or longest)
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_ctx  # room for every prompt of a burst in one llama_decode
        params.n_seq_max = width
        # A KV stream per sequence: with one unified pool every token attends over all the
        # sequences' cells (masked), so a step at 64 sequences cost 4x one at 32 here.
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = self.threads
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens for {width} sequences")
        self.scheduler = BatchScheduler(lib, self.ctx, self.vocab, n_seq_max=width, n_batch=n_ctx,
                                        n_ctx_seq=self.n_ctx_train or n_ctx, sampling=self.sampling,
                                        ignore_eos=self.ignore_eos)
        self._thread = serve_in_thread(self.scheduler)

    def _close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
            self._thread.join()
            self.scheduler.close()
            self._max_decode_batch = self.scheduler.max_decode_batch
            self.scheduler = None
        if self.ctx is not None:
            self.lib.llama_free(self.ctx)
            self.ctx = None

    async def timed(self, requests: Sequence[BenchRequest], offsets: Sequence[float], max_concurrency: Optional[int],
                    on_done: OnDone) -> tuple[list[RequestRecord], float]:
        assert self.scheduler is not None
        self.scheduler.max_decode_batch = 0  # count the timed requests only, not the warm-up
        return await super().timed(requests, offsets, max_concurrency, on_done)

    async def send(self, request: BenchRequest, record: RequestRecord) -> None:
        if self.scheduler is None:
            raise RuntimeError("llama.cpp runner: no context (send is called within run)")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def settle(error: Optional[BaseException]) -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(None)

        self.scheduler.submit(Job(request.prompt_ids, request.max_tokens, on_token=lambda _token: record.add_chunk(1),
                                  on_done=lambda error: loop.call_soon_threadsafe(settle, error)))
        await done

    def generate_ids(self, prompts: Sequence[Sequence[int]], max_tokens: int, width: int) -> list[list[int]]:
        """The output token ids of ``prompts`` on a fresh context of ``width`` sequences, all
        submitted at once (blocking; after :meth:`start`). For checks, not timed."""
        self._open(width, max(len(p) for p in prompts) + max_tokens)
        outputs: list[list[int]] = [[] for _ in prompts]
        errors: list[BaseException] = []
        finished = threading.Semaphore(0)

        def on_done(error: Optional[BaseException]) -> None:
            if error is not None:
                errors.append(error)
            finished.release()

        try:
            assert self.scheduler is not None
            for prompt, ids in zip(prompts, outputs):
                self.scheduler.submit(Job(prompt, max_tokens, on_token=ids.append, on_done=on_done))
            for _ in prompts:
                finished.acquire()
        finally:
            self._close()
        if errors:
            raise errors[0]
        return outputs

    def run_info(self) -> dict[str, Any]:
        return {"max_decode_batch": self._max_decode_batch}

    async def stop(self) -> None:
        await asyncio.to_thread(self._close)
        if self.model is not None:
            self.lib.llama_model_free(self.model)
            self.model = None
