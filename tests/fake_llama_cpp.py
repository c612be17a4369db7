"""A fake of llama-cpp-python's low-level API (the ``llama_cpp`` module), for the benchmark's
llama.cpp runner: a toy "model" whose KV cache is checked as llama.cpp would use it.

Its next token after a sequence is the last token + 1, and ``EOS`` after ``STOP`` (so a prompt
ending in 45 yields 46..50 then EOS). ``llama_decode`` asserts what a real context requires:
sequence ids below ``n_seq_max``, positions that continue each sequence's cache (so a reused
sequence must have been cleared), and no more tokens than the batch holds. Every decoded batch
is recorded as ``(seq_id, pos, token, logits)`` tuples.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

EOS = 2
STOP = 50


class FakeLlamaCpp:
    """Stands in for the ``llama_cpp`` module (attributes are its functions)."""

    def __init__(self, n_ctx_train: int = 4096) -> None:
        self.n_ctx_train = n_ctx_train
        self.contexts: list[Any] = []  # params of every context created
        self.decodes: list[list[tuple[int, int, int, bool]]] = []
        self.kv: dict[int, list[int]] = {}
        self.fail_next: list[int] = []  # return codes for the next llama_decode calls
        self.live_samplers = 0
        self.live_contexts = 0
        self.model_freed = False
        self._outputs: dict[int, int] = {}
        self._n_seq_max = 0
        self._capacity = 0

    # model and context
    def llama_backend_init(self) -> None:
        pass

    def llama_model_default_params(self) -> Any:
        return SimpleNamespace()

    def llama_model_load_from_file(self, path: bytes, params: Any) -> str:
        assert isinstance(path, bytes) and path.endswith(b".gguf")
        return "model"

    def llama_model_get_vocab(self, model: str) -> str:
        return "vocab"

    def llama_model_n_ctx_train(self, model: str) -> int:
        return self.n_ctx_train

    def llama_model_free(self, model: str) -> None:
        self.model_freed = True

    def llama_context_default_params(self) -> Any:
        return SimpleNamespace(n_ctx=512, n_batch=2048, n_seq_max=1, kv_unified=False, n_threads=1, n_threads_batch=1)

    def llama_init_from_model(self, model: str, params: Any) -> str:
        self.contexts.append(SimpleNamespace(**vars(params)))
        self._n_seq_max = params.n_seq_max
        self.kv.clear()
        self.live_contexts += 1
        return "ctx"

    def llama_free(self, ctx: str) -> None:
        self.live_contexts -= 1

    def llama_get_memory(self, ctx: str) -> str:
        return "memory"

    def llama_memory_seq_rm(self, memory: str, seq_id: int, p0: int, p1: int) -> bool:
        assert (p0, p1) == (-1, -1)
        self.kv.pop(seq_id, None)
        return True

    # batches and decoding
    def llama_batch_init(self, n_tokens: int, embd: int, n_seq_max: int) -> Any:
        assert embd == 0 and n_seq_max == 1
        self._capacity = n_tokens
        return SimpleNamespace(n_tokens=0, token=[0] * n_tokens, pos=[0] * n_tokens, n_seq_id=[0] * n_tokens,
                               seq_id=[[0] for _ in range(n_tokens)], logits=[False] * n_tokens)

    def llama_batch_free(self, batch: Any) -> None:
        pass

    def llama_decode(self, ctx: str, batch: Any) -> int:
        n = batch.n_tokens
        assert 0 < n <= self._capacity
        rows = [(batch.seq_id[i][0], batch.pos[i], batch.token[i], bool(batch.logits[i])) for i in range(n)]
        assert all(batch.n_seq_id[i] == 1 for i in range(n))
        if self.fail_next:
            return self.fail_next.pop(0)  # llama.cpp leaves the cache as it was
        self.decodes.append(rows)
        self._outputs = {}
        for i, (seq, pos, token, logits) in enumerate(rows):
            assert 0 <= seq < self._n_seq_max, f"seq_id {seq} >= n_seq_max {self._n_seq_max}"
            cache = self.kv.setdefault(seq, [])
            assert pos == len(cache), f"seq {seq}: position {pos} after {len(cache)} cached tokens"
            cache.append(token)
            if logits:
                self._outputs[i] = EOS if token == STOP else token + 1
        return 0

    def llama_vocab_is_eog(self, vocab: str, token: int) -> bool:
        return token == EOS

    # samplers
    def llama_sampler_chain_default_params(self) -> Any:
        return SimpleNamespace()

    def llama_sampler_chain_init(self, params: Any) -> list:
        self.live_samplers += 1
        return []

    def llama_sampler_chain_add(self, chain: list, sampler: str) -> None:
        chain.append(sampler)

    def llama_sampler_init_greedy(self) -> str:
        return "greedy"

    def llama_sampler_init_temp(self, t: float) -> str:
        return f"temp={t}"

    def llama_sampler_init_top_k(self, k: int) -> str:
        return f"top_k={k}"

    def llama_sampler_init_top_p(self, p: float, min_keep: int) -> str:
        return f"top_p={p}"

    def llama_sampler_init_min_p(self, p: float, min_keep: int) -> str:
        return f"min_p={p}"

    def llama_sampler_init_dist(self, seed: int) -> str:
        return f"dist={seed}"

    def llama_sampler_sample(self, sampler: list, ctx: str, idx: int) -> int:
        assert sampler, "empty sampler chain"
        assert idx in self._outputs, f"no logits at batch index {idx}"
        return self._outputs[idx]

    def llama_sampler_free(self, sampler: list) -> None:
        self.live_samplers -= 1
